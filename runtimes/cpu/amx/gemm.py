"""An f32 matrix product on the CPU's AMX tile unit (Intel Sapphire Rapids and later), at f32 accuracy.

Why: numpy's BLAS (OpenBLAS) and PyTorch's (MKL) run f32 products on AVX-512: 32 f32 multiply-adds per cycle
per core. AMX multiplies bf16 tiles: ``tdpbf16ps`` does a 16x32 by 32x16 product (8192 multiply-adds) every 16
cycles, 512 per cycle, 16x more - but bf16 keeps only 8 significant bits of f32's 24.

"bf16x3": every f32 operand is cut exactly into three bf16 parts, ``x = hi + mid + lo`` (each part takes the top
8 bits of what the previous ones left: truncation, so the sum is exact and no part can overflow), and the product
is the sum of the six part products that matter, ``hi*hi + hi*mid + mid*hi + hi*lo + lo*hi + mid*mid``, each
bf16 x bf16 product exact in the f32 accumulator. What is dropped (``mid*lo + lo*mid + lo*lo``) is below 2^-22
of ``|x| |y|`` per term (2^-24 on average), the size of f32's own rounding: the result is as accurate as an f32
GEMM (tests/TOLERANCES.md's f32 matmul tolerance, checked against float64 in tests/runtimes/test_amx_gemm.py).
Six tile products leave at most 16/6 ~ 2.7x of AVX-512's peak; splitting and packing eat into it. Differences
from IEEE f32: AMX treats denormal bf16 inputs as zero (values below ~1e-38 lose their low parts).

Layouts (the C block is 32x32 f32: four 16x16 accumulator tiles, 0-3; A tiles 4-5, B tiles 6-7):
- A, per call and row block: ``[3 parts, rows, Kp]`` bf16 (as uint16), Kp = K rounded up to 32 with zeros; a
  tile is 16 rows x 32 k (64 bytes per row, the row stride Kp * 2): ``pack_a`` and ``_block``. ``gemm`` packs it
  tile by tile instead (``pack_a_tiles``, ``_block_tiles``: ``[rows / 32, Kp / 32, 3 parts, 32, 32]``, a tile
  1 KiB in one piece and a k step's six 6 KiB in order, ~10% faster).
- B, per 32-column panel: ``[3 parts, Kp / 2, 32, 2]`` bf16, the "VNNI" layout ``tdpbf16ps`` reads: each 4-byte
  element holds the two k of one column that a pair-wise dot product uses; a tile is 16 k-pairs x 16 columns.
The packed buffers are small (a row block of A and one panel of B, L2-sized): weights are never kept split.

Tile configuration (``ldtilecfg``): 64 bytes, byte 0 the palette (1), bytes 16-47 each tile's bytes per row
(uint16), bytes 48-63 each tile's rows (uint8); every tile here is 16 rows x 64 bytes.

Linux hands out AMX's 8 KiB of tile registers only to processes that ask (they enlarge every signal frame and
context switch): ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` grants it to the whole process, once;
without it the first tile instruction kills the process (SIGILL). ``runtimes/cpu/amx/`` asks before anything here
runs and checks the CPU. Each call releases the tiles when it ends (``tilerelease``: the thread's AMX state is
then "init" and costs nothing to switch).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..jit.spin import fetch_add as _fetch_add

BLOCK = 32  # rows and columns of C per micro-kernel call; also A's k per tile
PARTS = 3
# the six (A part, B part) products of a k step, in an order where each changes one operand: 14 tile loads per
# step (the first product loads two A and two B tiles, every later one two tiles) instead of 18 when grouped by
# A part (each A tile loaded once, the B tiles once per A part): 3-5% fewer ns per ``tdpbf16ps`` measured
# (6.4-6.6 vs 6.7-7.0 on 768 x 256 x 2304's blocks).
PRODUCTS = ((0, 2), (0, 1), (1, 1), (1, 0), (0, 0), (2, 0))

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(cache=True, inline="always", error_model="numpy")

_VOID, _I8, _I64 = ir.VoidType(), ir.IntType(8), ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()


def _amx(builder, name: str, *args):
    arg_types = [a.type for a in args]
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, arg_types), f"llvm.x86.{name}")
    builder.call(fn, list(args))


def _tile(i: int):
    return ir.Constant(_I8, i)


@intrinsic
def _load_config(typingctx, address):
    sig = types.none(types.intp)

    def codegen(context, builder, signature, args):
        _amx(builder, "ldtilecfg", builder.inttoptr(args[0], _PTR))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _release(typingctx):
    sig = types.none()

    def codegen(context, builder, signature, args):
        _amx(builder, "tilerelease")
        return context.get_dummy_value()

    return sig, codegen


def open_accumulators(builder, c, c_row, accumulate, count: int) -> list:
    """IR: accumulator tiles 0 .. ``count`` - 1 (16 x 16 f32 each, two per 16 rows of C at ``c``, rows ``c_row``
    bytes apart) loaded from C if ``accumulate`` is not 0, else zeroed; returns the tiles' addresses in C."""
    c_half = builder.mul(c_row, ir.Constant(_I64, 16))
    c_tiles = [builder.inttoptr(builder.add(c, builder.add(builder.mul(c_half, ir.Constant(_I64, t // 2)),
                                                           ir.Constant(_I64, 64 * (t % 2)))), _PTR)
               for t in range(count)]
    with builder.if_else(builder.icmp_signed("!=", accumulate, ir.Constant(_I64, 0))) as (then, otherwise):
        with then:
            for t in range(count):
                _amx(builder, "tileloadd64", _tile(t), c_tiles[t], c_row)
        with otherwise:
            for t in range(count):
                _amx(builder, "tilezero", _tile(t))
    return c_tiles


def ir_loop(builder, count, step: int, values: list):
    """IR: a loop ``j = 0, step, ...`` while ``j < count`` (none if ``count`` <= 0) carrying ``values`` (phis);
    returns the builder placed in the body, ``j``, the phis, and ``close(new values)`` which ends the loop and
    returns the values after it."""
    head = builder.block
    body = builder.append_basic_block("loop")
    done = builder.append_basic_block("loop.done")
    zero = ir.Constant(_I64, 0)
    builder.cbranch(builder.icmp_signed(">", count, zero), body, done)
    builder.position_at_end(body)
    j = builder.phi(_I64)
    j.add_incoming(zero, head)
    phis = []
    for v in values:
        phi = builder.phi(v.type)
        phi.add_incoming(v, head)
        phis.append(phi)

    def close(new_values):
        j_next = builder.add(j, ir.Constant(_I64, step))
        j.add_incoming(j_next, builder.block)
        for phi, v in zip(phis, new_values):
            phi.add_incoming(v, builder.block)
        end = builder.block
        builder.cbranch(builder.icmp_signed("<", j_next, count), body, done)
        builder.position_at_end(done)
        out = []
        for v, new in zip(values, new_values):
            phi = builder.phi(v.type)
            phi.add_incoming(v, head)
            phi.add_incoming(new, end)
            out.append(phi)
        return out

    return j, phis, close


def begin_k_loop(builder, steps):
    """IR: a loop over ``steps`` k steps (none if ``steps`` <= 0), the builder placed in its body; returns the
    step index and what ``end_k_loop`` needs."""
    s, _, close = ir_loop(builder, steps, 1, [])
    return s, close


def end_k_loop(builder, loop_state, c_tiles: list, c_row) -> None:
    """IR: the loop's back edge, then the accumulator tiles stored to their addresses in C."""
    loop_state([])
    for t, at in enumerate(c_tiles):
        _amx(builder, "tilestored64", _tile(t), at, c_row)


def _block_codegen(builder, args, tiles: bool):
    """The 32 x 32 block's LLVM IR: A's tiles addressed by rows of the whole K (``tiles`` False: ``a_rows``, the
    row stride, and the k step 64 bytes) or tile by tile (``tiles`` True: ``a_rows`` is the k step's stride, a
    tile's rows 64 bytes apart, the second tile 1 KiB after the first)."""
    a, a_rows, a_part, b, b_part, steps, c, c_row, accumulate = args
    c_tiles = open_accumulators(builder, c, c_row, accumulate, 4)
    s, loop_state = begin_k_loop(builder, steps)
    if tiles:
        a_s = builder.add(a, builder.mul(s, a_rows))
        a_row = ir.Constant(_I64, 2 * BLOCK)  # a tile row: 32 bf16
        a_half = ir.Constant(_I64, 16 * 2 * BLOCK)
    else:
        a_s = builder.add(a, builder.mul(s, ir.Constant(_I64, 2 * BLOCK)))  # 32 bf16 along k
        a_row = a_rows
        a_half = builder.mul(a_row, ir.Constant(_I64, 16))
    b_s = builder.add(b, builder.mul(s, ir.Constant(_I64, 16 * 2 * BLOCK * 2)))  # 16 k pairs x 32 columns
    panel_row = ir.Constant(_I64, BLOCK * 4)  # a VNNI row: 32 columns x 2 bf16
    loaded_a = loaded_b = None
    for pa, pb in PRODUCTS:
        if pa != loaded_a:
            a_p = builder.add(a_s, builder.mul(a_part, ir.Constant(_I64, pa)))
            _amx(builder, "tileloadd64", _tile(4), builder.inttoptr(a_p, _PTR), a_row)
            _amx(builder, "tileloadd64", _tile(5), builder.inttoptr(builder.add(a_p, a_half), _PTR), a_row)
            loaded_a = pa
        if pb != loaded_b:
            b_p = builder.add(b_s, builder.mul(b_part, ir.Constant(_I64, pb)))
            _amx(builder, "tileloadd64", _tile(6), builder.inttoptr(b_p, _PTR), panel_row)
            b_p2 = builder.add(b_p, ir.Constant(_I64, 64))
            _amx(builder, "tileloadd64", _tile(7), builder.inttoptr(b_p2, _PTR), panel_row)
            loaded_b = pb
        for t, (ta, tb) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
            _amx(builder, "tdpbf16ps", _tile(t), _tile(ta), _tile(tb))
    end_k_loop(builder, loop_state, c_tiles, c_row)


@intrinsic
def _block(typingctx, a, a_row, a_part, b, b_part, steps, c, c_row, accumulate):
    """C[32, 32] (f32, rows ``c_row`` bytes apart) = (C if ``accumulate`` else 0) + the sum over ``steps`` k steps
    of 32 of the six part products of A (tiles from ``a``: rows ``a_row`` bytes apart, parts ``a_part`` apart) and
    B (a VNNI panel at ``b``, parts ``b_part`` bytes apart). Addresses and strides in bytes."""
    sig = types.none(*([types.intp] * 9))

    def codegen(context, builder, signature, args):
        _block_codegen(builder, args, tiles=False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_tiles(typingctx, a, a_step, a_part, b, b_part, steps, c, c_row, accumulate):
    """``_block`` reading A in the layout ``pack_a_tiles`` writes: k steps ``a_step`` bytes apart, parts
    ``a_part`` apart, each part's two 16 x 32 tiles contiguous (1 KiB each)."""
    sig = types.none(*([types.intp] * 9))

    def codegen(context, builder, signature, args):
        _block_codegen(builder, args, tiles=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _bits(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _f32(typingctx, bits):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@_inline
def _split(x):
    """The three bf16 parts (as uint16) of an f32, exact truncations: x == hi + mid + lo; and 1 if x is not
    finite (inf - inf would make the parts NaN, and inf times a zero part gives NaN: the caller computes such
    products on BLAS instead), else 0."""
    bits = _bits(x)
    hi = bits >> np.uint32(16)
    r1 = x - _f32(hi << np.uint32(16))
    r1_bits = _bits(r1)
    mid = r1_bits >> np.uint32(16)
    r2 = r1 - _f32(mid << np.uint32(16))
    bad = 1 if (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000) else 0
    return np.uint16(hi), np.uint16(mid), np.uint16(_bits(r2) >> np.uint32(16)), bad


def _vector(value: int, lanes: int = 16, bits: int = 32):
    return ir.Constant(ir.VectorType(ir.IntType(bits), lanes), [value] * lanes)


def _split_bits(builder, x):
    """``_split`` on a <16 x float>: three <16 x i32> whose top 16 bits are the parts (the low bits are what the
    later parts hold), and an i64 1 if any lane is not finite."""
    i32x16 = ir.VectorType(ir.IntType(32), 16)
    f32x16 = x.type
    bits = builder.bitcast(x, i32x16)
    top = _vector(-65536)  # 0xFFFF0000
    r1 = builder.fsub(x, builder.bitcast(builder.and_(bits, top), f32x16))
    r1_bits = builder.bitcast(r1, i32x16)
    r2 = builder.fsub(r1, builder.bitcast(builder.and_(r1_bits, top), f32x16))
    exponent = _vector(0x7F800000)
    nonfinite = builder.icmp_unsigned("==", builder.and_(bits, exponent), exponent)
    mask = builder.bitcast(nonfinite, ir.IntType(16))
    bad = builder.zext(builder.icmp_unsigned("!=", mask, ir.Constant(ir.IntType(16), 0)), _I64)
    return [bits, r1_bits, builder.bitcast(r2, i32x16)], bad


def _split_vector(builder, x):
    """``_split`` on a <16 x float>: the three <16 x i16> parts, and an i64 1 if any lane is not finite."""
    i16x16 = ir.VectorType(ir.IntType(16), 16)
    parts, bad = _split_bits(builder, x)
    return [builder.trunc(builder.lshr(v, _vector(16)), i16x16) for v in parts], bad


_I8X64 = ir.VectorType(ir.IntType(8), 64)


def _top_halves(builder, first, second, order):
    """The top 16 bits of the 32 lanes of two <16 x i32> (``first``'s lanes 0-15, then ``second``'s) as a
    <64 x i8> of 32 bf16, bf16 ``q`` taken from lane ``order[q]``: one two-source byte permutation
    (``vpermt2b``, AVX512-VBMI, which every AMX CPU has), where truncating each vector and shuffling the halves
    took five instructions of the same port."""
    mask = [4 * order[q // 2] + 2 + q % 2 for q in range(64)]  # lanes 16-31 (second's) are bytes 64-127
    return builder.shuffle_vector(builder.bitcast(first, _I8X64), builder.bitcast(second, _I8X64),
                                  ir.Constant(ir.VectorType(ir.IntType(32), 64), mask))


def _transpose(builder, rows):
    """An n x n matrix held as n row vectors of n lanes, transposed: log2(n) butterfly stages, each swapping one
    bit of the row index with the same bit of the column index (one two-source shuffle per vector and stage)."""
    rows = list(rows)
    n = len(rows)
    lanes = ir.VectorType(ir.IntType(32), n)
    s = n // 2
    while s:
        low = ir.Constant(lanes, [j if j & s == 0 else n + j - s for j in range(n)])
        high = ir.Constant(lanes, [j + s if j & s == 0 else n + j for j in range(n)])
        for i in range(n):
            if i & s == 0:
                a, b = rows[i], rows[i + s]
                rows[i], rows[i + s] = builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high)
        s //= 2
    return rows


def _transpose16(builder, rows):
    """A 16 x 16 matrix of i32 held as 16 row vectors, transposed (``_transpose``)."""
    return _transpose(builder, rows)


@intrinsic
def _split_16(typingctx, src, out, part_bytes):
    """16 f32 at ``src`` split into three runs of 16 bf16 at ``out``, ``part_bytes`` apart; 1 if any is not
    finite."""
    sig = types.intp(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, out, part_bytes = args
        x = builder.load(builder.inttoptr(src, ir.VectorType(ir.FloatType(), 16).as_pointer()), align=4)
        parts, bad = _split_vector(builder, x)
        for p, part in enumerate(parts):
            at = builder.add(out, builder.mul(part_bytes, ir.Constant(_I64, p)))
            builder.store(part, builder.inttoptr(at, part.type.as_pointer()), align=2)
        return bad

    return sig, codegen


@intrinsic
def _pack_b_block(typingctx, src, row_bytes, out, part_bytes):
    """16 columns x 32 k of B read k-contiguous (column j at ``src + j * row_bytes``, 32 f32), split and written
    as 16 VNNI rows (k pairs) of 16 columns per part at ``out`` (rows ``BLOCK * 4`` bytes apart, parts
    ``part_bytes`` apart). 1 if any is not finite. The f32 are transposed before they are split, as 64-bit k
    pairs (four 8 x 8 transposes: 96 shuffles, where transposing each part's 32-bit words took 192 and cutting
    them to bf16 96 more); then one byte permutation per VNNI row and part takes the parts' top halves (the
    pack ran 0.19-0.20 instead of 0.28-0.31 ns per element, as fast as loading and storing the bytes)."""
    sig = types.intp(types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, row_bytes, out, part_bytes = args
        f32x16, i64x8 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(64), 8)
        pairs = []  # column j's k pairs 8h .. 8h + 7, as 64-bit lanes
        for j in range(16):
            column = builder.add(src, builder.mul(row_bytes, ir.Constant(_I64, j)))
            pairs.append([builder.load(builder.inttoptr(builder.add(column, ir.Constant(_I64, 64 * h)),
                                                        i64x8.as_pointer()), align=4) for h in range(2)])
        rows = [[None, None] for _ in range(16)]  # k pair t's columns 8c .. 8c + 7
        for c in range(2):
            for h in range(2):
                for r, row in enumerate(_transpose(builder, [pairs[8 * c + j][h] for j in range(8)])):
                    rows[8 * h + r][c] = row
        bad = ir.Constant(_I64, 0)
        order = list(range(32))  # column j's pair is lanes 2j, 2j + 1 of the two halves in turn
        for t in range(16):
            halves = []
            for c in range(2):
                split, nonfinite = _split_bits(builder, builder.bitcast(rows[t][c], f32x16))
                halves.append(split)
                bad = builder.or_(bad, nonfinite)
            for p in range(PARTS):
                row = _top_halves(builder, halves[0][p], halves[1][p], order)
                at = builder.add(builder.add(out, builder.mul(part_bytes, ir.Constant(_I64, p))),
                                 ir.Constant(_I64, t * BLOCK * 4))
                builder.store(row, builder.inttoptr(at, _I8X64.as_pointer()), align=4)
        return bad

    return sig, codegen


@intrinsic
def _pack_b_pair(typingctx, src, row_bytes, out, part_bytes):
    """Two rows of B (k and k + 1) x 16 columns read n-contiguous at ``src`` and ``src + row_bytes``, split and
    interleaved into one VNNI row of 16 columns per part at ``out`` (parts ``part_bytes`` apart). 1 if any is
    not finite."""
    sig = types.intp(types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, row_bytes, out, part_bytes = args
        f32x16 = ir.VectorType(ir.FloatType(), 16)
        split = [_split_bits(builder, builder.load(builder.inttoptr(at, f32x16.as_pointer()), align=4))
                 for at in (src, builder.add(src, row_bytes))]
        rows = [parts for parts, _ in split]
        interleave = [j // 2 + 16 * (j % 2) for j in range(32)]  # column j: k from the first row, then the second
        for p in range(PARTS):
            pairs = _top_halves(builder, rows[0][p], rows[1][p], interleave)
            at = builder.add(out, builder.mul(part_bytes, ir.Constant(_I64, p)))
            builder.store(pairs, builder.inttoptr(at, _I8X64.as_pointer()), align=4)
        return builder.or_(split[0][1], split[1][1])

    return sig, codegen


@intrinsic
def _split_32(typingctx, src, out, part_bytes):
    """``_split_16`` on 32 f32: three runs of 32 bf16 (one byte permutation each)."""
    sig = types.intp(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, out, part_bytes = args
        f32x16 = ir.VectorType(ir.FloatType(), 16)
        split = [_split_bits(builder, builder.load(builder.inttoptr(builder.add(src, ir.Constant(_I64, 64 * h)),
                                                                    f32x16.as_pointer()), align=4))
                 for h in range(2)]
        for p in range(PARTS):
            run = _top_halves(builder, split[0][0][p], split[1][0][p], list(range(32)))
            at = builder.add(out, builder.mul(part_bytes, ir.Constant(_I64, p)))
            builder.store(run, builder.inttoptr(at, _I8X64.as_pointer()), align=2)
        return builder.or_(split[0][1], split[1][1])

    return sig, codegen


@intrinsic
def _load_f32(typingctx, address):
    sig = types.float32(types.intp)

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.FloatType().as_pointer()), align=4)

    return sig, codegen


@_inline
def _put(out, p_index, i, j, x):
    h, m, lo, bad = _split(x)
    out[0, p_index, i, j] = h
    out[1, p_index, i, j] = m
    out[2, p_index, i, j] = lo
    return bad


# The operands are passed as (address, row stride, column stride) in bytes, so that one compiled version serves
# every layout (contiguous, transposed, strided, read-only): numba compiles one per array type, seconds each.


@_kernel
def pack_a(a, a_rs, a_cs, r0, r1, k0, k1, out):
    """Rows ``r0:r1`` x k ``k0:k1`` of A split into ``out`` [3, 1, rows, Kc] (Kc a multiple of 32): padding zero
    (k past ``k1``, rows up to the next multiple of 32). Returns 1 if A has a value that is not finite."""
    bad = 0
    kc = out.shape[3]
    k = k1 - k0
    k16 = k - k % 16 if a_cs == 4 else 0
    for i in range(min(out.shape[2], (r1 - r0 + BLOCK - 1) // BLOCK * BLOCK)):  # the rows the blocks read
        start = 0
        if r0 + i < r1:
            src = a + (r0 + i) * a_rs + k0 * a_cs
            dst = out.ctypes.data + i * out.strides[2]
            for j in range(0, k16, 16):
                bad |= _split_16(src + j * 4, dst + j * 2, out.strides[0])
            for j in range(k16, k):
                bad |= _put(out, 0, i, j, _load_f32(src + j * a_cs))
            start = k
        for j in range(start, kc):
            out[0, 0, i, j] = 0
            out[1, 0, i, j] = 0
            out[2, 0, i, j] = 0
    return bad


@intrinsic
def _store_u16(typingctx, address, value):
    sig = types.none(types.intp, types.uint16)

    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(16).as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


@_kernel
def pack_a_tiles(a, a_rs, a_cs, r0, r1, k0, k1, out):
    """``pack_a`` in the layout ``gemm`` reads: rows ``r0:r1`` x k ``k0:k1`` of A split into ``out`` [rows / 32,
    Kc / 32, 3, 32, 32] (Kc a multiple of 32): per block of 32 rows and k step of 32, the three parts' 32 x 32
    bf16 one after another, so that a k step's six A tiles are 6 KiB read in order (rows of the whole K apart,
    as ``pack_a`` has them, they ran ~10% slower: 9.5-9.8 vs 8.6-8.8 ns per ``tdpbf16ps``). Padding zero (k past
    ``k1``, rows up to the next multiple of 32). Returns 1 if A has a value that is not finite."""
    bad = 0
    kc = out.shape[1] * BLOCK
    step_bytes, part_bytes = out.strides[1], out.strides[2]
    k = k1 - k0
    k16 = k - k % 16 if a_cs == 4 else 0
    k32 = k - k % BLOCK if a_cs == 4 else 0
    for i in range(min(out.shape[0] * BLOCK, (r1 - r0 + BLOCK - 1) // BLOCK * BLOCK)):  # the rows the blocks read
        row = out.ctypes.data + (i // BLOCK) * out.strides[0] + (i % BLOCK) * (2 * BLOCK)
        start = 0
        if r0 + i < r1:
            src = a + (r0 + i) * a_rs + k0 * a_cs
            for j in range(0, k32, BLOCK):  # a whole tile row per part
                bad |= _split_32(src + j * 4, row + (j // BLOCK) * step_bytes, part_bytes)
            for j in range(k32, k16, 16):
                bad |= _split_16(src + j * 4, row + (j // BLOCK) * step_bytes + (j % BLOCK) * 2, part_bytes)
            for j in range(k16, k):
                h, m, lo, nonfinite = _split(_load_f32(src + j * a_cs))
                at = row + (j // BLOCK) * step_bytes + (j % BLOCK) * 2
                _store_u16(at, h)
                _store_u16(at + part_bytes, m)
                _store_u16(at + 2 * part_bytes, lo)
                bad |= nonfinite
            start = k
        for j in range(start, kc):
            at = row + (j // BLOCK) * step_bytes + (j % BLOCK) * 2
            _store_u16(at, np.uint16(0))
            _store_u16(at + part_bytes, np.uint16(0))
            _store_u16(at + 2 * part_bytes, np.uint16(0))
    return bad


@_kernel
def pack_b(b, b_rs, b_cs, k0, k1, c0, c1, out):
    """k ``k0:k1`` x columns ``c0:c1`` (at most 32) of B split into the VNNI panel ``out`` [3, Kc / 2, 32, 2]:
    padding zero. 16 x 32 blocks in registers where k or the columns are contiguous, else element by element.
    Returns 1 if B has a value that is not finite."""
    bad = 0
    k = k1 - k0
    cols = c1 - c0
    base = b + k0 * b_rs + c0 * b_cs
    if cols < BLOCK or k % BLOCK:
        out[:] = 0  # padding: columns past c1, k past k1
    if b_rs == 4 and cols % 16 == 0:  # k contiguous (a weight [N, K] used as w.T): transposed in registers
        k32 = k - k % BLOCK
        for j in range(0, cols, 16):
            for kk in range(0, k32, BLOCK):
                at = out.ctypes.data + (kk // 2) * out.strides[1] + j * 4
                bad |= _pack_b_block(base + j * b_cs + kk * 4, b_cs, at, out.strides[0])
        for j in range(cols):
            for kk in range(k32, k):
                bad |= _put(out, kk // 2, j, kk % 2, _load_f32(base + j * b_cs + kk * 4))
    elif b_cs == 4 and cols % 16 == 0:  # columns contiguous: row pairs interleaved in registers
        for kk in range(0, k - k % 2, 2):
            for j in range(0, cols, 16):
                at = out.ctypes.data + (kk // 2) * out.strides[1] + j * 4
                bad |= _pack_b_pair(base + kk * b_rs + j * 4, b_rs, at, out.strides[0])
        if k % 2:
            for j in range(cols):
                bad |= _put(out, k // 2, j, 0, _load_f32(base + (k - 1) * b_rs + j * 4))
    else:
        for kk in range(k):
            for j in range(cols):
                bad |= _put(out, kk // 2, j, kk % 2, _load_f32(base + kk * b_rs + j * b_cs))
    return bad


@_inline
def configure(config):
    """Fill ``config`` [64] uint8 (every tile 16 rows x 64 bytes) and load it."""
    config[:] = 0
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t] = 64  # bytes per row
        config[48 + t] = 16  # rows
    _load_config(config.ctypes.data)


@_inline
def _row_blocks(a_buf, i0, i1, panel, j0, j1, steps, c, edge, more):
    """``c[i0:i1, j0:j1] (+)= `` the packed rows of A (``a_buf`` as ``pack_a_tiles`` writes it, from row ``i0``)
    times one packed VNNI panel of B, 32 x 32 blocks; blocks past the edge of ``c`` go through ``edge``."""
    a_step = a_buf.strides[1]
    a_part = a_buf.strides[2]
    c_row = c.strides[0]
    for ib in range(i0, i1, BLOCK):
        a_addr = a_buf.ctypes.data + (ib - i0) // BLOCK * a_buf.strides[0]
        if ib + BLOCK <= i1 and j1 - j0 == BLOCK:
            _block_tiles(a_addr, a_step, a_part, panel.ctypes.data, panel.strides[0], steps,
                   c.ctypes.data + ib * c_row + j0 * 4, c_row, more)
        else:  # a block past the edge of c: computed in ``edge``
            rows, cols = min(BLOCK, i1 - ib), j1 - j0
            if more:
                edge[:] = 0
                edge[:rows, :cols] = c[ib:ib + rows, j0:j1]
            _block_tiles(a_addr, a_step, a_part, panel.ctypes.data, panel.strides[0], steps, edge.ctypes.data,
                   BLOCK * 4, more)
            c[ib:ib + rows, j0:j1] = edge[:rows, :cols]


@_kernel
def gemm(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, c0, c1, a_buf, b_buf, edge, config, a_packed):
    """``c[r0:r1, c0:c1] = a[r0:r1] @ b[:, c0:c1]``: A [M, k] and B [k, N] f32 at addresses ``a`` and ``b``
    (strides in bytes), ``c`` an f32 array with contiguous rows. Scratch: ``a_buf`` [rows / 32, Kc / 32, 3, 32,
    32] and ``b_buf`` [3, Kc / 2, 32, 2] uint16 (Kc a multiple of 32: k is taken Kc at a time, the partial sums
    kept in ``c``), ``edge`` [32, 32] f32, ``config`` [64] uint8 (filled here). The rows are packed ``rows`` at a
    time. ``a_packed``: ``a_buf`` already holds these rows of A (one block of rows and of k, packed by an earlier
    call on other columns). Returns 1, leaving ``c`` unfinished, as soon as it meets an operand value that is not
    finite."""
    kc = a_buf.shape[1] * BLOCK
    a_rows = a_buf.shape[0] * BLOCK
    configure(config)
    for k0 in range(0, max(k, 1), kc):
        k1 = min(k0 + kc, k)
        steps = (k1 - k0 + BLOCK - 1) // BLOCK
        more = 1 if k0 > 0 else 0
        for i0 in range(r0, r1, a_rows):
            i1 = min(i0 + a_rows, r1)
            if not a_packed and pack_a_tiles(a, a_rs, a_cs, i0, i1, k0, k1, a_buf):
                _release()
                return 1
            for j0 in range(c0, c1, BLOCK):
                j1 = min(j0 + BLOCK, c1)
                if pack_b(b, b_rs, b_cs, k0, k1, j0, j1, b_buf):
                    _release()
                    return 1
                _row_blocks(a_buf, i0, i1, b_buf, j0, j1, steps, c, edge, more)
    _release()
    return 0


@_kernel
def gemm_rows(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, a_buf, panels, edge, config, b_packed):
    """``c[r0:r1] = a[r0:r1] @ b`` (every column of ``c``) with all of B packed at once into ``panels`` [P, 3,
    Kc / 2, 32, 2] (P = columns / 32 rounded up, Kc >= k: one block of k), for products with fewer columns than
    rows: a part packs B on its first call (``b_packed`` 0) and then takes blocks of rows in turn with the other
    parts, never packing B again. Otherwise as ``gemm`` (``a_buf`` [rows / 32, Kc / 32, 3, 32, 32] holds
    ``rows`` rows of A at a time); returns 1, leaving ``c`` unfinished, as soon as it meets an operand value
    that is not finite."""
    n = c.shape[1]
    a_rows = a_buf.shape[0] * BLOCK
    steps = (k + BLOCK - 1) // BLOCK
    configure(config)
    if not b_packed:
        for p in range((n + BLOCK - 1) // BLOCK):
            if pack_b(b, b_rs, b_cs, 0, k, p * BLOCK, min(n, (p + 1) * BLOCK), panels[p]):
                _release()
                return 1
    for i0 in range(r0, r1, a_rows):
        i1 = min(i0 + a_rows, r1)
        if pack_a_tiles(a, a_rs, a_cs, i0, i1, 0, k, a_buf):
            _release()
            return 1
        for p in range((n + BLOCK - 1) // BLOCK):
            _row_blocks(a_buf, i0, i1, panels[p], p * BLOCK, min(n, (p + 1) * BLOCK), steps, c, edge, 0)
    _release()
    return 0





# ---- whole products the CPU chains can call: never refusing, chunks claimed in compiled code -------------------
# A value that is not finite makes ``gemm`` / ``gemm_rows`` give up (in bf16 parts inf times a zero part is NaN
# where IEEE gives inf). The kernels below then compute the region they were given one f32 multiply and add at
# a time (``plain_product``), so that a product is one compiled call per part whatever its operands hold: the
# chains call it without a Python step around it (``runtimes/cpu/amx/__init__.py`` ``product``). Which regions
# go plain is fixed by the operands and the plan alone (a chunk, or a part's fixed block), never by which part
# claimed which chunk: a product's bits do not depend on the schedule.


@_kernel
def plain_product(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, c0, c1):
    """``c[r0:r1, c0:c1] = a[r0:r1] @ b[:, c0:c1]``, each element one f32 sum over k in order (no fused
    multiply-add, no reassociation): IEEE's infinities and NaNs where numpy's product has them."""
    for i in range(r0, r1):
        for j in range(c0, c1):
            total = np.float32(0.0)
            for t in range(k):
                total += _load_f32(a + i * a_rs + t * a_cs) * _load_f32(b + t * b_rs + j * b_cs)
            c[i, j] = total


@_kernel
def _finite(x, rs, cs, r0, r1, c0, c1):
    """Whether every value of ``x[r0:r1, c0:c1]`` (f32 at address ``x``, strides in bytes) is finite."""
    for i in range(r0, r1):
        for j in range(c0, c1):
            if not np.isfinite(_load_f32(x + i * rs + j * cs)):
                return False
    return True


@_kernel
def gemm_part(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, c0, c1, a_buf, b_buf, edge, config):
    """``gemm`` of a fixed block, or ``plain_product`` of it where an operand value there is not finite."""
    if gemm(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, c0, c1, a_buf, b_buf, edge, config, 0):
        plain_product(a, a_rs, a_cs, b, b_rs, b_cs, k, c, r0, r1, c0, c1)


@_kernel
def gemm_row_chunks(a, a_rs, a_cs, b, b_rs, b_cs, k, c, chunks, counter, a_buf, panels, edge, config):
    """One part of a product whose parts take chunks of rows in turn: ``gemm_rows`` over the chunks of
    ``chunks`` [count, 2] it claims from ``counter[0]`` (shared by the parts, zeroed before), in compiled code
    rather than by a Python call per chunk; B packed on the part's first chunk, as the calls one by one do. A
    chunk is computed the same whichever part takes it: by ``plain_product`` where B or the chunk's rows of A
    hold a value that is not finite."""
    at = np.int64(counter.ctypes.data)
    n = c.shape[1]
    packed = 0
    b_plain = False
    while True:
        j = _fetch_add(at, np.int64(1))
        if j >= chunks.shape[0]:
            return
        lo, hi = chunks[j, 0], chunks[j, 1]
        if b_plain or gemm_rows(a, a_rs, a_cs, b, b_rs, b_cs, k, c, lo, hi, a_buf, panels, edge, config, packed):
            if not packed:  # B is packed whole before any row of A: refused there, every chunk goes plain
                b_plain = b_plain or not _finite(b, b_rs, b_cs, 0, k, 0, n)
            plain_product(a, a_rs, a_cs, b, b_rs, b_cs, k, c, lo, hi, 0, n)
        packed = 1


@_kernel
def gemm_col_chunks(a, a_rs, a_cs, b, b_rs, b_cs, k, c, m, chunks, counter, a_buf, b_buf, edge, config):
    """``gemm_row_chunks`` for chunks of columns (every row ``0:m``): ``gemm`` per chunk, A (one block of rows
    and of k: the plan's condition for column chunks) packed on the part's first chunk, before any column of
    B."""
    at = np.int64(counter.ctypes.data)
    packed = 0
    a_plain = False
    while True:
        j = _fetch_add(at, np.int64(1))
        if j >= chunks.shape[0]:
            return
        lo, hi = chunks[j, 0], chunks[j, 1]
        if a_plain or gemm(a, a_rs, a_cs, b, b_rs, b_cs, k, c, 0, m, lo, hi, a_buf, b_buf, edge, config, packed):
            if not packed:
                a_plain = a_plain or not _finite(a, a_rs, a_cs, 0, m, 0, k)
            plain_product(a, a_rs, a_cs, b, b_rs, b_cs, k, c, 0, m, lo, hi)
        packed = 1


@_kernel
def reset(counter):
    """``counter[0] = 0``: the next run's chunks start from the first."""
    counter[0] = 0
