"""numpy kernels of GGUF block-quantized weights (``graph.gguf_blocks``): the ``Dequant`` primitive,
``GatherDequant`` (an embedding lookup: only the picked rows are decoded) and ``DequantMatMulGGUF`` (``x @
dequant(W).T`` with W kept packed).

With numba (``runtimes/cpu/jit/gguf_kernels.py``):

- decode (``Dequant``, ``GatherDequant``, the prefill bands below): one compiled pass per row, the rows split over
  the cores, bit for bit ``gguf_blocks.dequantize``;
- a product with few rows of x: for Q4_0, Q4_1, Q8_0 and the K-quants (``gguf_q8.PRODUCTS``) up to
  ``INTEGER_ROWS`` rows (decoding a token, a small batch or a short prompt), x is rounded to integers per block
  of 32 and the blocks' byte codes are dotted with it in integers (``gguf_q8``, llama.cpp's scheme with 15-bit
  rather than 8-bit x), the output rows split over the cores, each part rounding x itself into its own scratch
  (``gguf_q8.quant_product``: one call, one chain phase per product); each weight row is read from memory once and
  decoded once per 4 rows of x. Q4_0, Q4_1 and Q8_0 on AVX512-VNNI hosts: on the weight repacked into tiles of 16
  rows (``gguf_tiles``, made once per read-only buffer at the first bind: ``gguf_tile_cache``), the parts cut at
  whole tiles. Other types, up to ``FUSED_ROWS`` rows: one pass over the packed weight
  in f32, each block decoded once and used for every row of x (``gguf_jit.matmul_rows`` or the type's own loops);
- more rows (a prompt): bands of weight rows decoded into an f32 scratch (``BAND`` elements) on every core, each
  band one BLAS product, so a long prompt runs at the speed of the dense product (compute-bound).

Without numba the bands are decoded by ``gguf_blocks.dequantize`` (numpy): same values, slower.
"""

from __future__ import annotations

import math

import numpy as np

from luminal_recipes.errors import InputError
from luminal_recipes.graph import gguf_blocks

from ...kernels.context import Bind, KernelContext
from .. import jit
from .. import threads as cpu_threads
from .common import F32, bind_all, with_refresh
from .operands import operand

CHAIN_PART = 1 << 14  # weight elements per part at least, in a chain run in lockstep (there a part costs a spin
# barrier, not a hand-off): a 192 x 576 weight (SmolLM2's k, v) in two parts of 6 tiles
FUSED_ROWS = 4    # rows of x up to which the fused f32 pass runs (it decodes per row of x: more rows take the bands)
INTEGER_ROWS = 64  # rows of x up to which the integer products run (gguf_q8: decoded once per 4 rows of x, ~45-55
# GFLOP/s on one Zen 4 core; the bands' exact decoding + BLAS win from ~200 rows)
BAND = 1 << 20    # decoded weight elements per band of the prefill path (4 MiB of f32: stays in L2/L3)

_F16 = None


def _jit():
    """``gguf_jit`` and the f16 table, or (None, None) without numba."""
    global _F16
    if not jit.AVAILABLE:
        return None, None
    from ..jit import gguf_kernels as gguf_jit

    if _F16 is None:
        _F16 = gguf_jit.f16_table()
    return gguf_jit, _F16


def layout(qtype: str, k: int) -> tuple[int, int, int, int, int, bool]:
    """(kind, elements per block, bytes per block, elements per sub-block, sub-blocks, has a minimum) of the
    compiled kernels for rows of ``k`` elements."""
    from ..jit.gguf_kernels import FLOAT_BLOCK, KINDS, LAYOUT

    kind = KINDS[qtype]
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    sl, nsub, has_c = LAYOUT[kind]
    if bs == 1:  # float rows: walked FLOAT_BLOCK elements at a time where K allows
        fb = FLOAT_BLOCK if k % FLOAT_BLOCK == 0 else 1
        return kind, fb, ts * fb, fb, 1, False
    return kind, bs, ts, sl, nsub, has_c


def _decoder(qtype: str, k: int):
    """``decode(packed [r, row_bytes], out f32 [r, k]) -> step`` on every core (compiled), or numpy's."""
    gj, f16 = _jit()
    if gj is None:
        def numpy_decode(packed, out):
            def run():
                out[...] = gguf_blocks.dequantize(packed, qtype)
            return run

        return numpy_decode
    kind, bs, ts, sl, nsub, has_c = layout(qtype, k)

    def compiled_decode(packed, out):
        return jit.by_rows(gj.dequant_any, [packed, out], kind, bs, ts, sl, nsub, has_c, f16)

    return compiled_decode


def _qtype(ctx: KernelContext) -> str:
    qtype = ctx.node.attr("qtype")
    if qtype not in gguf_blocks.QTYPES:
        ctx.fail(f"unknown GGUF quantization type {qtype!r}")
    return qtype


def prepare_dequant(ctx: KernelContext) -> Bind:
    qtype = _qtype(ctx)
    in_shape = ctx.inputs[0].view.shape
    rb, k = in_shape[-1], ctx.shape[-1]
    if gguf_blocks.row_bytes(qtype, k) != rb or ctx.shape[:-1] != in_shape[:-1]:
        ctx.fail(f"packed {in_shape} does not decode to {ctx.shape} as {qtype}")
    rows = math.prod(in_shape[:-1])
    p_op = operand(ctx, 0, shape=(rows, rb))
    acc = None if ctx.dtype == F32 else ctx.scratch.add((rows, k), F32)
    decode = _decoder(qtype, k)

    def bind(out, flats, scratch):
        (packed,) = bind_all([p_op], flats, scratch)
        target = out.reshape(rows, k) if acc is None else scratch[acc]
        run = decode(packed, target)
        if acc is None:
            return with_refresh([p_op], run)

        def body():
            run()
            np.copyto(out.reshape(rows, k), target, casting="unsafe")

        return with_refresh([p_op], body)

    return bind


def prepare_gather_dequant(ctx: KernelContext) -> Bind:
    qtype = _qtype(ctx)
    t_shape, i_shape = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    k = ctx.shape[-1]
    if len(t_shape) != 2 or gguf_blocks.row_bytes(qtype, k) != t_shape[1] or ctx.shape != i_shape + (k,):
        ctx.fail(f"table {t_shape} and indices {i_shape} do not give {ctx.shape} as {qtype}")
    vocab, rb = t_shape
    n = math.prod(i_shape)
    t_op, i_op = operand(ctx, 0), operand(ctx, 1, shape=(n,))
    pos = ctx.scratch.add((n,), np.intp)
    picked = ctx.scratch.add((n, rb), np.uint8)  # the picked rows' packed bytes (a row is a few hundred bytes)
    acc = None if ctx.dtype == F32 else ctx.scratch.add((n, k), F32)
    decode = _decoder(qtype, k)
    node_id = ctx.node.id

    def bind(out, flats, scratch):
        table, idx = bind_all([t_op, i_op], flats, scratch)
        target = out.reshape(n, k) if acc is None else scratch[acc]
        rows = scratch[picked]
        run = decode(rows, target)
        where = scratch[pos]

        def body():
            if n == 0:
                return
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= vocab:
                raise InputError(f"GatherDequant #{node_id}: index out of range [0, {vocab}) in {lo}..{hi}; check "
                                 f"token ids against the vocabulary size")
            np.copyto(where, idx, casting="unsafe")
            np.take(table, where, axis=0, out=rows, mode="clip")
            run()
            if acc is not None:
                np.copyto(out.reshape(n, k), target, casting="unsafe")

        return with_refresh([t_op, i_op], body)

    return bind


def prepare_dequant_matmul_gguf(ctx: KernelContext) -> Bind:
    qtype = _qtype(ctx)
    n_out, k_in = int(ctx.node.attr("out_features")), int(ctx.node.attr("in_features"))
    x_shape, w_shape = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    rb = gguf_blocks.row_bytes(qtype, k_in)
    if x_shape[-1] != k_in or ctx.shape != x_shape[:-1] + (n_out,) or math.prod(w_shape) != n_out * rb:
        ctx.fail(f"x {x_shape}, packed weight {w_shape} and out {ctx.shape} do not match {qtype} with "
                 f"in_features={k_in}, out_features={n_out}")
    rows = math.prod(x_shape[:-1])
    x_op = operand(ctx, 0, dtype=F32, shape=(rows, k_in), blas=True)
    w_op = operand(ctx, 1, shape=(n_out, rb))
    acc = None if ctx.dtype == F32 else ctx.scratch.add((rows, n_out), F32)
    gj, f16 = _jit()
    kind = integer = None
    if gj is not None:
        kind, bs, ts, sl, nsub, has_c = layout(qtype, k_in)
        from ..jit import gguf_q8

        integer = kind in gguf_q8.KINDS and k_in % 32 == 0 and rows <= INTEGER_ROWS
    fused = gj is not None and (rows <= FUSED_ROWS or integer)
    if fused:
        if integer:  # x rounded to integers per block of 32 by every part for itself (its own scratch: one phase,
            # no barrier between the rounding and the product), integer dot products (gguf_q8.py)
            from ..jit import gguf_tiles

            tileable = gguf_tiles.AVAILABLE and kind in gguf_tiles.KINDS and n_out >= gguf_tiles.TILE
            if tileable:  # parts of whole tiles of 16 rows (gguf_tiles.py); the rows past the last tile: the last
                n_tiles = n_out // gguf_tiles.TILE

                def tile_parts():
                    return [slice(p.start * gguf_tiles.TILE, n_out if p.stop == n_tiles else p.stop * gguf_tiles.TILE)
                            for p in cpu_threads.split(n_tiles, gguf_tiles.TILE * k_in * max(rows, 1))]

                q_splits = tile_parts()
                # in a chain run in lockstep a part costs no hand-off: small weights (SmolLM2's 192 x 576 k and v,
                # below MIN_PART as one part, all on thread 0 beside q's half) split over the threads there too
                with cpu_threads.finer_parts(CHAIN_PART):
                    c_splits = tile_parts()
            else:
                q_splits = c_splits = cpu_threads.split(n_out, k_in * max(rows, 1))
            n_sets = max(len(q_splits), len(c_splits))
            x_q = [ctx.scratch.add((rows, 2 * k_in), np.int8) for _ in range(n_sets)]
            x_d = [ctx.scratch.add((rows, k_in // 32), F32) for _ in range(n_sets)]
            x_s = [ctx.scratch.add((rows, k_in // 32), F32) for _ in range(n_sets)]
            x_16 = [ctx.scratch.add((rows, k_in // 16), F32) for _ in range(n_sets)] if nsub == 16 else x_s
        else:
            sums = ctx.scratch.add((rows, k_in // sl), F32)
            x_c = ctx.scratch.add((rows, k_in), F32)  # x as one contiguous block (BLAS views may be strided)
    else:
        band = max(1, min(n_out, BAND // max(k_in, 1)))
        dense = ctx.scratch.add((band, k_in), F32)
        decode = _decoder(qtype, k_in)

    def bind(out, flats, scratch):
        x, w = bind_all([x_op, w_op], flats, scratch)
        target = out.reshape(rows, n_out) if acc is None else scratch[acc]
        if fused and integer:
            tiles = _tiles(w, kind, w_op, target) if tileable else None

            def part_calls(splits):
                if tiles is not None:  # part i: its tiles, and the rows past the last whole tile where it has them
                    return [(gguf_tiles.quant_tiles, (x, scratch[x_q[i]], scratch[x_d[i]], scratch[x_s[i]], tiles, w,
                                                      target, p.start // gguf_tiles.TILE, p.stop // gguf_tiles.TILE,
                                                      p.stop // gguf_tiles.TILE * gguf_tiles.TILE if p.stop == n_out
                                                      else n_out, kind, f16), i) for i, p in enumerate(splits)]
                return [(gguf_q8.quant_product, (x, scratch[x_q[i]], scratch[x_d[i]], scratch[x_s[i]],
                                                 scratch[x_16[i]], w, target, p.start, p.stop, kind, f16), i)
                        for i, p in enumerate(splits)]

            def access(calls, splits):
                """what each part touches (chain.Call.access): x, the weight and the f16 table read, its own
                scratch and its rows of the output written - so products of one x (q/k/v, gate/up) need no barrier
                between them"""
                reads = (x, w, f16) if tiles is None else (x, tiles, w, f16)
                return [(*call, (reads, (*call[1][1:4], *(() if tiles is not None else call[1][4:5]),
                                         target[:, p.start:p.stop]))) for call, p in zip(calls, splits)]

            calls = part_calls(q_splits)
            compute = cpu_threads.parallel([lambda fn=fn, args=args: fn(*args) for fn, args, _ in calls])
            compute = _described(compute, access(calls, q_splits))
            n_tiles = n_out // gguf_tiles.TILE
            shared = (tiles is not None and gguf_tiles.SHARED and len(c_splits) > 1
                      and n_tiles * gguf_tiles.tile_bytes(kind, k_in // 32) >= gguf_tiles.SHARED_MIN_BYTES)
            if shared:
                # a chain in lockstep: the parts share the tiles out in chunks (``gguf_tiles.quant_tiles_shared``:
                # the same bits, no part waiting for a slower one); each may write any row of the output
                parts = len(c_splits)
                chunk = gguf_tiles.chunk_tiles(n_tiles, gguf_tiles.tile_bytes(kind, k_in // 32), parts)
                flags = gguf_tiles.counter()  # this binding's ticket
                fine = [(gguf_tiles.quant_tiles_shared,
                         (x, scratch[x_q[i]], scratch[x_d[i]], scratch[x_s[i]], tiles, w, target,
                          n_tiles * gguf_tiles.TILE if i == parts - 1 else n_out, kind, f16, flags, parts, chunk), i,
                         ((x, tiles, w, f16), (scratch[x_q[i]], scratch[x_d[i]], scratch[x_s[i]], target, flags)))
                        for i in range(parts)]
                from ..jit.chain import Call

                def rechain(fine=fine):
                    return [[Call(fn, args, part, access=a) for fn, args, part, a in fine]]

                rechain.always = True
                compute.rechain = rechain
            elif c_splits != q_splits:  # a chain in lockstep takes the finer parts (chain.finer: ``rechain``)
                fine = access(part_calls(c_splits), c_splits)
                from ..jit.chain import Call

                def rechain(fine=fine):
                    return [[Call(fn, args, part, access=a) for fn, args, part, a in fine]]

                rechain.always = True  # whatever the chain's own minimum part (chain.finer)
                compute.rechain = rechain
        elif fused:
            xc, xs = scratch[x_c], scratch[sums]
            special = gj.SPECIALISED.get(kind)
            splits = cpu_threads.split(n_out, k_in * max(rows, 1))
            if special is not None:  # the type's own loops (vectorised), else the generic block decoder's
                calls = [(special, (w, xc, xs, target, p.start, p.stop, kind, f16), i) for i, p in enumerate(splits)]
            else:
                calls = [(gj.matmul_rows, (w, xc, xs, target, p.start, p.stop, kind, bs, ts, sl, nsub, has_c, f16),
                          i) for i, p in enumerate(splits)]
            parts = [lambda fn=fn, args=args: fn(*args) for fn, args, _ in calls]
            products = cpu_threads.parallel(parts)

            def compute():
                np.copyto(xc, x)
                gj._sums(xc, xs, sl)
                products()

            if x.dtype == xc.dtype and x.shape == xc.shape:
                from ..jit.chain import copy_region

                compute = _described(compute, [(copy_region, (xc, xc, x, False), None)],
                                     [(gj._sums, (xc, xs, sl), None)], calls)
        else:
            steps = []
            for n0 in range(0, n_out, band):
                n1 = min(n0 + band, n_out)
                wd = scratch[dense][: n1 - n0]
                steps.append((decode(w[n0:n1], wd), wd.T, target[:, n0:n1]))

            def compute():
                with cpu_threads.blas_for(rows * k_in * n_out):  # a prompt's small products: BLAS on this thread
                    for dec, wt, dst in steps:
                        dec()
                        np.matmul(x, wt, out=dst)

        if acc is None:  # the product alone (described for the chains where it is compiled calls)
            return with_refresh([x_op, w_op], compute)

        def body():
            compute()
            np.copyto(out.reshape(rows, n_out), target, casting="unsafe")

        return with_refresh([x_op, w_op], body)

    return bind


def _tiles(w, kind, w_op, target):
    """The weight's tiles of 16 rows (``gguf_tile_cache``: repacked once per buffer, at the first bind), or None
    where the per-row loops run: the weight read through a scratch copy (refreshed every step), output rows not
    contiguous, or a weight the cache does not tile (writable, ...)."""
    from ..jit import gguf_tile_cache

    if w_op.refresh is not None or target.strides[1] != target.itemsize:
        return None
    return gguf_tile_cache.tiles_for(w, kind)


def _described(step, *phases):
    """``step`` described as ``phases`` of ``(kernel, args, part)`` calls - or ``(kernel, args, part, (reads,
    writes))``: ``chain.Call.access`` - for the chains (``jit/chain.py``)."""
    from ..jit.chain import Call, tag

    return tag(step, *([Call(fn, args, part, access=rest[0] if rest else None) for fn, args, part, *rest in phase]
                       for phase in phases))


PREPARE = {
    "Dequant": prepare_dequant,
    "GatherDequant": prepare_gather_dequant,
    "DequantMatMulGGUF": prepare_dequant_matmul_gguf,
}
