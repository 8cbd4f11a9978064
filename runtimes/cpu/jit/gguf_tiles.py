"""GGUF Q4_0, Q4_1 and Q8_0 products on weights repacked into tiles of 16 rows (llama.cpp's answer on AVX512-VNNI
CPUs: ggml-cpu ``amx/mmq.cpp``, ``tinygemm_kernel_vnni``), with ``gguf_q8``'s integer math unchanged: x rounded
per block of 32 to 15-bit codes ``v = 128 hi + lo`` (``gguf_q8.quantize``), an exact int32 dot per weight block,
then one f32 fused multiply-add by the block's scales.

Why: ``gguf_q8``'s loops take one weight row at a time; per block of 32 codes a scalar f16 scale is converted and
broadcast, the nibbles are unpacked with shuffles and the 8 lanes are reduced at the end - on an Intel core (ports
0/1 fused for 512 bits, shuffles on port 5 only) those uops, not memory, bound the loop. Here one 64-byte load
holds 16 rows x 4 consecutive codes, and one 512-bit ``vpdpbusd`` dots them with x's 4 codes broadcast from memory
(``vpbroadcastd``, a load-port op): the 16 int32 lanes are 16 output rows. No horizontal reduction, no per-block
broadcast of a weight scale, no shuffle.

Layout (``repack``; a tile of 16 rows is ``nblk`` blocks of 32 elements; tiles one after the other, each
64-byte aligned), per tile:

- codes, ``nblk`` blocks of ``CODES[kind]`` bytes, each 64-byte vectors whose byte ``4 r + j`` belongs to row r:
  Q4_0/Q4_1, 4 vectors: vector v holds bytes ``4 v .. 4 v + 3`` of each row's 16 code bytes, unchanged (a byte's
  low nibble is element ``4 v + j``, its high nibble element ``16 + 4 v + j``: ``& 15`` gives the group of 4
  elements ``v``, ``>> 4`` the group ``4 + v``); Q8_0, 8 vectors: vector g holds codes ``4 g .. 4 g + 3`` of each
  row, flipped to unsigned (``q + 128``: one xor at repack time; the ``128 sum(v)`` that adds is taken off by
  starting the high-byte accumulator at ``-sum(v)``, as ``gguf_q8``'s Q8_0 loop does);
- the 16 rows' f16 ``d`` of every block (32 bytes per block: one load, one ``vcvtph2ps``);
- Q4_1 only: the 16 rows' f16 ``m`` of every block, likewise.

Per block and row of x: the 8 groups' codes times x's high bytes and, separately, its low bytes (two int32 chains
each - low and high nibble groups - for one tile and one row of x: the ``vpdpbusd`` latency), ``(hi << 7) + lo``
exact, then ``acc += f32(dot) * (d_w * d_x)`` and the offset term (Q4_0: ``d_w * (-8 xs)``; Q4_1: ``m_w * xs``;
xs = d_x sum(v)) in a second accumulator. Decoding (one row of x) takes two tiles per pass, t and t + half the
part's range (``NT``: two streams far apart sharing each broadcast of x; +8% out of cache over one tile per pass,
as ``gguf_q8``'s NR rows); a small batch takes one tile per pass and one to ``MR`` rows of x sharing each loaded
weight vector, more rows the tile again (in L1: a tile of a row of 2048 elements is 20-35 KiB).

Measured on the 2-core Intel Xeon (AVX512-VNNI, AMX) of issue 23 (bench/README.md, "GGUF products on tiles"):
with the weight in L2 the tiled loops run ~3x ``gguf_q8``'s (Q4_1 ~30-37 GB/s of packed weight vs ~11), out of
cache ~+40% (Q4_1 7.1-7.5 GB/s vs 5.1) and ~+25% (Q8_0 ~10.6 vs 8.3-9.3); software prefetch (512 B to 8 KiB
ahead) gained nothing.

The runtime (``kernels/gguf.py``) repacks each weight once, at its first bind (``gguf_tile_cache``: kept per
read-only buffer, the file's pages then released), and cuts the threads' parts at whole tiles.

Rows past the last whole tile (``n % 16``) stay on ``gguf_q8``'s per-row loops over the original buffer; so do
hosts whose numba target lacks avx512vnni + avx512bw (``AVAILABLE``).

Numerics (tests/TOLERANCES.md, family ``xint15``): the same as ``gguf_q8`` (the same integers; f32 rounding of the
scales' products and of the accumulation in another order).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import gguf_q8 as q8
from .gguf_q8 import FLT, I8, I16, I32, I64, _c, _fma, _i64, _ld, _v
from .spin import atomic_load, compare_exchange, fetch_add

TILE = 16  # weight rows per tile: the 16 int32 lanes of a 512-bit vpdpbusd
MR = 4  # rows of x per pass (each loaded weight vector shared by them)
KINDS = (0, 1, 4)  # Q4_0, Q4_1, Q8_0
BLOCK_BYTES = {0: 18, 1: 20, 4: 34}  # GGUF bytes per block of 32, per row
CODES = {0: 256, 1: 256, 4: 512}  # tile bytes of codes per block
SCALES = {0: 32, 1: 64, 4: 32}  # tile bytes of f16 scales per block (d; Q4_1 also m)
ENV = "LUMINAL_RECIPES_GGUF_TILES"  # "0": every product on gguf_q8's per-row loops (an A/B switch, read at import)
AVAILABLE = q8._VNNI512 is not None and q8._F16C and os.environ.get(ENV, "").strip() != "0"

_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")


def tile_bytes(kind: int, nblk: int) -> int:
    return nblk * (CODES[kind] + SCALES[kind])


def _dp(builder, acc, u, x):
    return q8._dpbusd64(builder, acc, u, x)


def _bcast(builder, base, off):
    """x's 4 bytes at ``off`` repeated 16 times (<64 x i8>): one ``vpbroadcastd`` from memory."""
    w = _ld(builder, base, off, I32)
    vec = builder.insert_element(ir.Constant(_v(I32, 16), ir.Undefined), w, ir.Constant(I32, 0))
    vec = builder.shuffle_vector(vec, ir.Constant(_v(I32, 16), ir.Undefined), ir.Constant(_v(I32, 16), [0] * 16))
    return builder.bitcast(vec, _v(I8, 64))


def _fsplat(builder, value):
    vec = builder.insert_element(ir.Constant(_v(FLT, 16), ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_v(FLT, 16), ir.Undefined), ir.Constant(_v(I32, 16), [0] * 16))


def _halves(builder, base, off):
    """16 f16 at ``off`` as <16 x float> (one ``vcvtph2ps``)."""
    h = builder.bitcast(_ld(builder, base, off, _v(I16, 16)), _v(ir.HalfType(), 16))
    return builder.fpext(h, _v(FLT, 16))


def _tile_body(builder, kind, mr, tps, nblk, xrow, drow, srow, orows):
    """The IR of one pass: the tiles at ``tps`` (one or two bases) times ``mr`` rows of x; stores 16 floats per
    tile and row of x at ``orows[tile][i]``."""
    codes_at = ir.Constant(I64, CODES[kind])
    d_base = builder.mul(nblk, codes_at)
    m_base = builder.add(d_base, builder.mul(nblk, ir.Constant(I64, 32)))
    zero_f = _c(FLT, 16, 0.0)
    zero_i = _c(I32, 16, 0)
    nt = len(tps)
    acc = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(mr)] for _ in range(nt)]
    macc = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(mr)] for _ in range(nt)]
    split = mr * nt == 1  # two chains per byte half (low / high groups) for one row of x: vpdpbusd's latency
    with cgutils.for_range(builder, nblk) as loop:
        b = loop.index
        co = builder.mul(b, codes_at)
        so = builder.mul(b, ir.Constant(I64, 32))
        groups, dws, mws = [], [], []
        for tp in tps:
            if kind == 4:
                groups.append([_ld(builder, tp, builder.add(co, ir.Constant(I64, 64 * g)), _v(I8, 64))
                               for g in range(8)])
            else:
                raw = [_ld(builder, tp, builder.add(co, ir.Constant(I64, 64 * v)), _v(I8, 64)) for v in range(4)]
                groups.append([builder.and_(w, _c(I8, 64, 15)) for w in raw]
                              + [builder.lshr(w, _c(I8, 64, 4)) for w in raw])
            dws.append(_halves(builder, tp, builder.add(d_base, so)))
            mws.append(_halves(builder, tp, builder.add(m_base, so)) if kind == 1 else None)
        xo = builder.mul(b, ir.Constant(I64, 64))
        fo = builder.mul(b, ir.Constant(I64, 4))
        for i in range(mr):
            if kind == 4:  # the high half starts at -sum(v): (q + 128) . v - 128 sum(v) = q . v
                init = builder.bitcast(_bcast(builder, srow[i], fo), _v(I32, 16))
            else:
                init = zero_i
            hi = [[init, zero_i] if split else [init] for _ in range(nt)]
            lo = [[zero_i, zero_i] if split else [zero_i] for _ in range(nt)]
            for g in range(8):
                c = g // 4 if split else 0
                xh = _bcast(builder, xrow[i], builder.add(xo, ir.Constant(I64, 4 * g)))
                xl = _bcast(builder, xrow[i], builder.add(xo, ir.Constant(I64, 32 + 4 * g)))
                for t in range(nt):
                    hi[t][c] = _dp(builder, hi[t][c], groups[t][g], xh)
                    lo[t][c] = _dp(builder, lo[t][c], groups[t][g], xl)
            dx = _fsplat(builder, _ld(builder, drow[i], fo, FLT))
            if kind != 4:
                xs = _ld(builder, srow[i], fo, FLT)
                term = _fsplat(builder, builder.fmul(xs, ir.Constant(FLT, -8.0)) if kind == 0 else xs)
            for t in range(nt):
                h = hi[t][0] if len(hi[t]) == 1 else builder.add(hi[t][0], hi[t][1])
                lsum = lo[t][0] if len(lo[t]) == 1 else builder.add(lo[t][0], lo[t][1])
                dot = builder.add(builder.shl(h, _c(I32, 16, 7)), lsum)
                sv = builder.fmul(dws[t], dx)
                a_ = acc[t][i]
                builder.store(_fma(builder, builder.sitofp(dot, _v(FLT, 16)), sv, builder.load(a_)), a_)
                if kind != 4:  # Q4_0: d_w (-8 xs); Q4_1: m_w xs
                    m_ = macc[t][i]
                    builder.store(_fma(builder, dws[t] if kind == 0 else mws[t], term, builder.load(m_)), m_)
    for t in range(nt):
        for i in range(mr):
            total = builder.load(acc[t][i])
            if kind != 4:
                total = builder.fadd(total, builder.load(macc[t][i]))
            builder.store(total, builder.bitcast(orows[t][i], _v(FLT, 16).as_pointer()), align=4)


def _tile_kernel(kind, nt=1):
    """An intrinsic ``(tiles, t, gap, xq, xd, xs, m0, mr, out) -> None``: out[m0 + i, 16 u + r] = x[m0 + i] .
    W[16 u + r] for the tiles u = t + j gap (j < nt), r < 16, i < mr (1 to ``MR``); x as ``gguf_q8.quantize``
    wrote it (Q8_0: xs holds -sum(v) as int32 bits); out's rows contiguous (stride 4 bytes along n)."""

    @intrinsic
    def kernel(typingctx, tiles, t, gap, xq, xd, xs, m0, mr_, out):
        def codegen(context, builder, sig, args):
            ta, tt, gapa, xqa, xda, xsa, m0a, mra, outa = args
            tty, _, _, txq, txd, txs, _, _, tout = sig.args

            def arr(ty, v):
                a = context.make_array(ty)(context, builder, v)
                return builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides, ty.ndim)

            tp, _ = arr(tty, ta)
            xqp, xqs = arr(txq, xqa)
            xdp, xds = arr(txd, xda)
            xsp, xss = arr(txs, xsa)
            outp, outs = arr(tout, outa)
            m0v = _i64(builder, m0a)
            k_len = cgutils.unpack_tuple(builder, context.make_array(txq)(context, builder, xqa).shape, 2)[1]
            nblk = builder.sdiv(k_len, ir.Constant(I64, 64))  # xq holds 64 bytes per block of 32
            tbytes = builder.mul(nblk, ir.Constant(I64, CODES[kind] + SCALES[kind]))
            units = [builder.add(_i64(builder, tt), builder.mul(_i64(builder, gapa), ir.Constant(I64, j)))
                     for j in range(nt)]
            tbases = [builder.gep(tp, [builder.mul(u, tbytes)]) for u in units]
            done = builder.append_basic_block("done")
            cases = [builder.append_basic_block(f"mr{mr}") for mr in range(1, MR + 1)]
            switch = builder.switch(_i64(builder, mra), done)
            for mr, bb in zip(range(1, MR + 1), cases):
                switch.add_case(ir.Constant(I64, mr), bb)
                builder.position_at_end(bb)

                def rows(p, s, mr=mr):
                    return [builder.gep(p, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), s[0])])
                            for i in range(mr)]

                orows = [[builder.gep(r, [builder.mul(builder.mul(u, ir.Constant(I64, TILE)), outs[1])])
                          for r in rows(outp, outs)] for u in units]
                _tile_body(builder, kind, mr, tbases, nblk, rows(xqp, xqs), rows(xdp, xds), rows(xsp, xss), orows)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(tiles, t, gap, xq, xd, xs, m0, mr_, out), codegen

    return kernel


NT = 2  # tiles per pass of one row of x (decoding): tiles t and t + half the range, two streams far apart
if AVAILABLE:
    _T = {k: (_tile_kernel(k, 1), _tile_kernel(k, NT)) for k in KINDS}
    _T0, _P0 = _T[0]
    _T1, _P1 = _T[1]
    _T4, _P4 = _T[4]
else:  # never called (``AVAILABLE`` gates every caller); stubs keep the module importable
    _T0 = _P0 = _T1 = _P1 = _T4 = _P4 = None


# tiles t0..t1 - 1: one row of x takes NT tiles far apart per pass; more rows take one tile per pass, ``MR``
# rows of x at a time (the tile stays in L1 between its passes)
@_fast
def tiles_q4_0(tiles, xq, xd, xs, out, t0, t1):
    h = (t1 - t0) // NT if xq.shape[0] == 1 else 0
    for j in range(h):
        _P0(tiles, t0 + j, h, xq, xd, xs, 0, 1, out)
    for t in range(t0 + h * NT, t1):
        for m0 in range(0, xq.shape[0], MR):
            _T0(tiles, t, 0, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out)


@_fast
def tiles_q4_1(tiles, xq, xd, xs, out, t0, t1):
    h = (t1 - t0) // NT if xq.shape[0] == 1 else 0
    for j in range(h):
        _P1(tiles, t0 + j, h, xq, xd, xs, 0, 1, out)
    for t in range(t0 + h * NT, t1):
        for m0 in range(0, xq.shape[0], MR):
            _T1(tiles, t, 0, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out)


@_fast
def tiles_q8_0(tiles, xq, xd, xs, out, t0, t1):
    h = (t1 - t0) // NT if xq.shape[0] == 1 else 0
    for j in range(h):
        _P4(tiles, t0 + j, h, xq, xd, xs, 0, 1, out)
    for t in range(t0 + h * NT, t1):
        for m0 in range(0, xq.shape[0], MR):
            _T4(tiles, t, 0, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out)


@_fast
def _neg_sums(xq, xs):
    """xs (int32 [m, k / 32]) = -sum(v) per block of ``quantize``'s xq (the Q8_0 tiles' correction)."""
    for m in range(xq.shape[0]):
        for b in range(xq.shape[1] // 64):
            t = np.int32(0)
            for j in range(32):
                t += np.int32(xq[m, 64 * b + j]) * np.int32(128) + np.int32(xq[m, 64 * b + 32 + j])
            xs[m, b] = -t


@_fast
def _round_x_and_tail(x, xq, xd, xs, packed, out, n_tail, kind, f16):
    """x rounded into this part's own scratch (``gguf_q8.quantize``), the rows n_tail .. n - 1 left past the last
    whole tile where this part is given them (``n_tail < n``) on gguf_q8's loops, then for Q8_0 -sum(v) per block
    over xs (after that loop: it takes x in its pair order, from the same codes)."""
    q8.quantize(x, xq, xd, xs)
    n = packed.shape[0]
    if n_tail < n:
        if kind == 4:
            q8.product_q8_0(packed, xq, xd, xs, out, n_tail, n, f16)
        elif kind == 0:
            q8.product_q4_0(packed, xq, xd, xs, out, n_tail, n, f16)
        else:
            q8.product_q4_1(packed, xq, xd, xs, out, n_tail, n, f16)
    if kind == 4:
        _neg_sums(xq, xs.view(np.int32))


@_fast
def _tiles(tiles, xq, xd, xs, out, t0, t1, kind):
    """Tiles t0..t1 - 1 (output rows 16 t0 .. 16 t1 - 1) of a product of ``kind``, x rounded (``_round_x_and_tail``)."""
    if kind == 4:
        tiles_q8_0(tiles, xq, xd, xs.view(np.int32), out, t0, t1)
    elif kind == 0:
        tiles_q4_0(tiles, xq, xd, xs, out, t0, t1)
    else:
        tiles_q4_1(tiles, xq, xd, xs, out, t0, t1)


@_fast
def quant_tiles(x, xq, xd, xs, tiles, packed, out, t0, t1, n_tail, kind, f16):
    """What the runtime's product step calls on every thread: x rounded into this part's own scratch, the rows
    past the last whole tile (the part given ``n_tail < n``: ``_round_x_and_tail``), tiles t0..t1 - 1."""
    _round_x_and_tail(x, xq, xd, xs, packed, out, n_tail, kind, f16)
    _tiles(tiles, xq, xd, xs, out, t0, t1, kind)


# ---- tiles shared out in chunks (lockstep chains) -------------------------------------------------------------
# In a lockstep chain the threads' fixed halves of a product finish up to tens of microseconds apart (memory
# bandwidth is not shared evenly from call to call; a thread the OS deschedules holds its half), and the other waits
# at the next barrier: on the ~1B Q8_0 model at 2 threads, ~1.5-2.5 ms a token of waits after the products.
# ``quant_tiles_shared`` lets every part take the next tiles no part has taken yet, from one ticket per product
# (``counter``), until none is left.
# Which thread computes a tile changes nothing in it: every tile's rows are computed by the same integer dots and
# f32 operations whichever pass (one tile, or two far apart) takes it, so the output is bit for bit the fixed
# parts'. The ticket word holds ``run * RUN_SPAN + next tile``: a part's run is its arrival count // parts, and a
# part whose run is newer than the ticket's starts the ticket over. Nothing needs resetting, so a chain aborted
# between two parts of a product (a part never called) cannot leave chunks unclaimed at the next run: the runs
# then disagree, and the newest part recomputes what an older one did (the same bits).
SHARED_ENV = "LUMINAL_RECIPES_GGUF_SHARED"  # "0": fixed parts in lockstep chains too (an A/B switch, read at import)
SHARED = AVAILABLE and os.environ.get(SHARED_ENV, "").strip() != "0"
RUN_SPAN = 1 << 24  # tile indices per run in the ticket word (a product has fewer tiles than that)
TICKET, ARRIVALS = 0, 8  # counter slots, a cache line apart (int64)
# products of fewer tile bytes keep the fixed parts: their claims (~10 compare-and-swaps moving a cache line between
# the cores, ~0.1-0.2 us each) cost more than their halves' imbalance - SmolLM2-135M, whose products are 69-553 KB,
# decoded 1.09x slower with every product shared (5.72 vs 5.24 ms/token, 2 threads, in turns)
SHARED_MIN_BYTES = 1 << 21
CHUNK_BYTES = 1 << 17  # tile bytes per claim at least: ~10 us of memory traffic on one core, a claim ~0.1 us
CHUNKS_PER_PART = 4  # the least claim is a quarter of a part or less, so the last one's tail is short


def chunk_tiles(n_tiles: int, tile_bytes_: int, parts: int) -> int:
    """The least claim, in tiles: even (a decoding pass takes two), ``CHUNK_BYTES`` or more, yet a
    ``CHUNKS_PER_PART``-th of a part or less where the product has that many tiles."""
    want = -(-CHUNK_BYTES // max(tile_bytes_, 1))
    most = max(2, n_tiles // (CHUNKS_PER_PART * max(parts, 1)))
    size = max(2, min(want, most))
    return size + size % 2


def counter() -> np.ndarray:
    """A product's ticket and arrival count (int64, zero): one per product and binding."""
    return np.zeros(16, np.int64)


@_fast
def _claim(flags, run, n_tiles, parts, least):
    """The next tiles of ``run`` no part has taken, as ``(first, end)``: a share of what is left (guided
    self-scheduling: ``left / (2 parts)``, ``least`` at least, so a product takes ~10-20 claims - each moves the
    ticket's cache line between the cores - and its last ones are small); ``(-1, -1)`` when none is left or a
    newer run holds the ticket."""
    while True:
        v = atomic_load(flags, TICKET)
        held, nxt = v // RUN_SPAN, v % RUN_SPAN
        if held > run:
            return -1, -1
        if held < run:  # the first part of this run: the ticket starts over
            nxt = 0
        elif nxt >= n_tiles:
            return -1, -1
        take = min(n_tiles - nxt, max(least, (n_tiles - nxt) // (2 * parts)))
        if compare_exchange(flags, TICKET, v, run * RUN_SPAN + nxt + take):
            return nxt, nxt + take


@_fast
def quant_tiles_shared(x, xq, xd, xs, tiles, packed, out, n_tail, kind, f16, flags, parts, chunk):
    """``quant_tiles`` as one of ``parts`` parts sharing a product's tiles (``flags``: the product's ``counter``):
    x rounded into this part's own scratch, the rows past the last whole tile where this part is given them
    (``n_tail < n``), then claims of ``chunk`` tiles or more (``_claim``) until none is left. Every one of the
    ``parts`` parts must be called once per run."""
    _round_x_and_tail(x, xq, xd, xs, packed, out, n_tail, kind, f16)
    n_tiles = packed.shape[0] // TILE
    run = fetch_add(flags.ctypes.data + ARRIVALS * flags.itemsize, 1) // parts
    while True:
        t0, t1 = _claim(flags, run, n_tiles, parts, chunk)
        if t0 < 0:
            return
        _tiles(tiles, xq, xd, xs, out, t0, t1, kind)


# ---- repacking ----------------------------------------------------------------------------------------------
@_fast
def _repack(packed, tiles, kind, nblk):
    """``packed`` (uint8 [n, nblk * bytes per block], GGUF rows) -> ``tiles`` (uint8, n // 16 tiles, layout above)."""
    bb = 18 if kind == 0 else (20 if kind == 1 else 34)
    qo = bb - (32 if kind == 4 else 16)  # offset of the codes in a GGUF block
    cb = 512 if kind == 4 else 256
    tb = nblk * (cb + (64 if kind == 1 else 32))
    flip = np.uint8(128 if kind == 4 else 0)
    for t in range(packed.shape[0] // 16):
        base = t * tb
        for r in range(16):
            row = packed[16 * t + r]
            for b in range(nblk):
                o = b * bb
                c = base + b * cb + 4 * r
                for v in range(cb // 64):
                    for j in range(4):
                        tiles[c + 64 * v + j] = row[o + qo + 4 * v + j] ^ flip
                s = base + nblk * cb + 32 * b + 2 * r
                tiles[s] = row[o]
                tiles[s + 1] = row[o + 1]
                if kind == 1:
                    s += nblk * 32
                    tiles[s] = row[o + 2]
                    tiles[s + 1] = row[o + 3]


def repack(packed: np.ndarray, kind: int) -> np.ndarray:
    """GGUF rows (uint8 [n, row bytes]) of Q4_0 / Q4_1 / Q8_0 as ``n // 16`` tiles (uint8, 64-byte aligned)."""
    n, rb = packed.shape
    nblk = rb // BLOCK_BYTES[kind]
    size = (n // TILE) * tile_bytes(kind, nblk)
    raw = np.empty(size + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    tiles = raw[skip:skip + size]
    if size:
        _repack(np.ascontiguousarray(packed), tiles, kind, nblk)
    return tiles
