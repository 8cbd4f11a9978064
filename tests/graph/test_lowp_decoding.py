"""FP8/FP4 decoding by the graph's Cast, for every code, against ml_dtypes, torch and the byte-level reference
of the seed (``seed/000_175c0034c0d8e12e.txt`` lines 14742-14960: ``fp8_e4m3_to_f32``, ``FP4_E2M1_LUT``,
``dequant_byte``), ported here from Rust; and NVFP4 nibble order checked both ways."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from luminal_recipes import ops
from luminal_recipes.graph import Graph, run_reference

# ---- the seed's scalar reference, ported line by line ------------------------------------------------------
FP4_E2M1_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def fp8_e4m3_to_f32(byte: int) -> float:
    """Finite-only E4M3 decoding (bias 7); the seed leaves the NaN codes 0x7F/0xFF unhandled."""
    sign = (byte >> 7) & 0x1
    exp = (byte >> 3) & 0xF
    mant = byte & 0x7
    if exp == 0:
        v = 0.0 if mant == 0 else (mant / 8.0) * (1.0 / 64.0)  # subnormal: 2^-6 * mant/8
    else:
        v = (1.0 + mant / 8.0) * 2.0 ** (exp - 7)
    return -v if sign else v


def dequant_byte(packed: int, lo_block_scale: float, scale_2: float) -> tuple[float, float]:
    lo, hi = packed & 0xF, (packed >> 4) & 0xF
    return FP4_E2M1_LUT[lo] * lo_block_scale * scale_2, FP4_E2M1_LUT[hi] * lo_block_scale * scale_2


def test_ported_reference_matches_the_seeds_own_tests():
    assert FP4_E2M1_LUT[0] == 0.0 and math.copysign(1, FP4_E2M1_LUT[8]) == -1 and FP4_E2M1_LUT[7] == 6.0
    assert FP4_E2M1_LUT[15] == -6.0
    assert fp8_e4m3_to_f32(0x00) == 0.0 and math.copysign(1, fp8_e4m3_to_f32(0x80)) == -1
    assert (fp8_e4m3_to_f32(0x38), fp8_e4m3_to_f32(0x40), fp8_e4m3_to_f32(0x3C)) == (1.0, 2.0, 1.5)
    lo, hi = dequant_byte(0x12, 2.0, 0.5)
    assert abs(lo - 1.0) < 1e-6 and abs(hi - 0.5) < 1e-6


# ---- graph decoding of every code --------------------------------------------------------------------------
def _decode(codes: np.ndarray, fmt: str, to: str = "f32") -> np.ndarray:
    """Feed raw codes as a ``fmt`` input and Cast it to ``to`` in a graph."""
    g = Graph()
    x = g.input("codes", codes.shape, fmt)
    g.mark_output("y", x.cast(to))
    return run_reference(g, {"codes": codes.view(x.dtype.np)})["y"]


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal including the sign of zero, with NaN equal to NaN."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(want)
    return bool(
        np.array_equal(np.isnan(got), nan)
        and np.array_equal(got[~nan], want[~nan])
        and np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))
    )


@pytest.mark.parametrize(
    ("fmt", "np_type", "torch_type"),
    [
        ("f8e4m3", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
        ("f8e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2),
    ],
)
@pytest.mark.parametrize("to", ["f32", "f16", "bf16"])
def test_fp8_all_256_codes(fmt, np_type, torch_type, to):
    codes = np.arange(256, dtype=np.uint8)
    got = _decode(codes, fmt, to)
    assert _same_bits(got, codes.view(np_type).astype(np.float32))
    assert _same_bits(got, torch.from_numpy(codes).view(torch_type).float().numpy())


def test_fp8_e4m3_matches_the_seed_reference():
    codes = np.arange(256, dtype=np.uint8)
    got = _decode(codes, "f8e4m3")
    nan_codes = {0x7F, 0xFF}  # E4M3FN has no infinities; S.1111.111 is NaN
    want = np.array([fp8_e4m3_to_f32(int(c)) for c in codes])
    finite = np.array([int(c) not in nan_codes for c in codes])
    assert _same_bits(got[finite], want[finite])
    assert np.isnan(got[~finite]).all()


def test_fp4_e2m1_all_16_codes():
    codes = np.arange(16, dtype=np.uint8)
    got = _decode(codes, "f4e2m1")
    assert _same_bits(got, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert _same_bits(got, np.array(FP4_E2M1_LUT))
    assert _same_bits(_decode(codes, "f4e2m1", "bf16"), np.array(FP4_E2M1_LUT))


def test_fp4_table_of_the_op_library_is_the_seeds():
    assert _same_bits(ops.quant.E2M1_VALUES, np.array(FP4_E2M1_LUT))


# ---- NVFP4 nibble order ------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_unpack_every_byte_in_both_orders(order):
    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
    g = Graph()
    g.mark_output("codes", ops.unpack_fp4_codes(g.input("w", (16, 16), "u8"), order))
    codes = run_reference(g, {"w": packed})["codes"]
    low, high = packed & 0xF, packed >> 4
    first, second = (low, high) if order == "low_first" else (high, low)
    assert codes.shape == (16, 32)
    assert np.array_equal(codes[:, 0::2], first) and np.array_equal(codes[:, 1::2], second)


def test_modelopt_dequant_equals_the_seeds_dequant_byte_for_every_byte():
    """ModelOpt layout (element 0 in the low nibble): each byte decodes to the seed's ``(lo, hi)`` pair."""
    packed = np.arange(256, dtype=np.uint8).reshape(32, 8)  # [out=32, in=16]: one scale block per row
    scales = (np.arange(32) % 4 + 1).astype(ml_dtypes.float8_e4m3fn).reshape(32, 1)
    g = Graph()
    w = ops.dequant_nvfp4(
        g.input("w", (32, 8), "u8"),
        g.input("s", (32, 1), "f8e4m3"),
        g.input("s2", (), "f32"),
        32,
        16,
        layout="modelopt",
    )
    g.mark_output("w", w)
    got = run_reference(g, {"w": packed, "s": scales, "s2": np.float32(0.5).reshape(())})["w"]
    for row in range(32):
        block_scale = float(scales[row, 0])
        for j in range(8):
            lo, hi = dequant_byte(int(packed[row, j]), block_scale, 0.5)
            assert (got[row, 2 * j], got[row, 2 * j + 1]) == (lo, hi)


@pytest.mark.parametrize(("order", "expected"), [("low_first", (1.0, 0.5)), ("high_first", (0.5, 1.0))])
def test_byte_0x12_in_both_orders(order, expected):
    g = Graph()
    codes = ops.unpack_fp4_codes(g.input("w", (1, 1), "u8"), order)
    g.mark_output("v", ops.embedding(codes, g.constant(np.array(FP4_E2M1_LUT, np.float32))))
    got = run_reference(g, {"w": np.array([[0x12]], np.uint8)})["v"]
    assert tuple(got.reshape(-1).tolist()) == expected
