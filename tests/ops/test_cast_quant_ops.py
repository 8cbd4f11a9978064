"""Casts between every pair of dtypes (vs ml_dtypes and torch), FP8 dequantisation (per tensor / per channel)
and NVFP4 dequantisation in both layouts, with packed inputs built here from the published format."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
import torch

from luminal_recipes import ops
from luminal_recipes.errors import QuantizationError
from luminal_recipes.graph import DType

ALL = [d.value for d in DType]
TORCH = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f8e4m3": torch.float8_e4m3fn,
    "f8e5m2": torch.float8_e5m2,
    "i32": torch.int32,
    "u8": torch.uint8,
    "bool": torch.bool,
}

# values every target can hold without overflow (u8: non-negative; f4e2m1: |x| <= 6; f8e4m3: |x| <= 448)
_SAFE = np.array(
    [0.0, -0.0, 0.25, 0.74, 1.0, 1.5, 2.49, 2.5, 3.7, 5.0, 6.0, -1.25, -3.3, -6.0], dtype=np.float64
)


def _source(src: str) -> np.ndarray:
    """Test values already representable in ``src`` (the graph input)."""
    npd = DType(src).np
    if src == "bool":
        return np.array([True, False, True, True, False])
    if src == "u8":
        return np.array([0, 1, 2, 5, 6, 200, 255], dtype=np.uint8)
    if src == "i32":
        return np.array([0, 1, -1, 3, -6, 17, 255, 4097, -100000], dtype=np.int32)
    return _SAFE.astype(npd)


def _ml_dtypes_cast(x: np.ndarray, dst: str) -> np.ndarray:
    if dst == "bool":
        return x != 0
    with np.errstate(over="ignore"):  # overflow to inf/NaN is part of what is checked
        return x.astype(DType(dst).np)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(ALL, ALL)))
def test_cast_matches_ml_dtypes_and_torch(src, dst, run_op, assert_close):
    x = _source(src)
    if dst == "u8" and src not in ("u8", "bool"):
        values = x.astype(np.float64)  # numbers outside 0..255 have no u8 value (C leaves them undefined)
        x = x[(values >= 0) & (values <= 255)]
    got = run_op(lambda t: ops.cast(t, dst), x)
    want = _ml_dtypes_cast(x, dst)
    assert np.array_equal(np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64)))
    assert_close("cast", got, want.astype(np.float64))
    if DType(dst).is_float:  # the sign of zero survives the conversion
        assert np.array_equal(np.signbit(got.astype(np.float64)), np.signbit(want.astype(np.float64)))
    if src in TORCH and dst in TORCH:
        # torch saturates f8e4m3 overflow to 448 where ml_dtypes gives NaN: compare the in-range values only
        in_range = ~np.isnan(want.astype(np.float64)) | np.isnan(x.astype(np.float64))
        want_torch = _to_torch(x, src).to(TORCH[dst]).to(torch.float64).numpy()
        assert_close("cast", got[in_range], want_torch[in_range])


def _to_torch(x: np.ndarray, src: str) -> torch.Tensor:
    """The same bits as a torch tensor (torch cannot read ml_dtypes arrays directly)."""
    if src.startswith("f8"):
        return torch.from_numpy(x.view(np.uint8)).view(TORCH[src])
    if src == "bf16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


@pytest.mark.parametrize("dst", ["f16", "bf16", "f8e4m3", "f8e5m2", "f4e2m1"])
def test_cast_rounds_to_nearest_even(dst, run_op, assert_close, rng):
    """Random f32 values (including ties and overflow) rounded exactly as ml_dtypes rounds them."""
    x = np.concatenate([rng.standard_normal(200) * 8, [1e6, -1e6, 0.75, 0.25, 5.0, 2.5, 65520.0]]).astype(
        np.float32
    )
    got = run_op(lambda t: ops.cast(t, dst), x)
    with np.errstate(over="ignore"):
        want = x.astype(DType(dst).np)
    assert_close("cast", got, want.astype(np.float64))


def test_f32_to_f8e4m3_overflow_is_nan_unlike_torch_saturation(run_op):
    """Documented difference: ml_dtypes (and so this interpreter) turn |x| > 464 into NaN; torch gives 448."""
    got = run_op(lambda t: ops.cast(t, "f8e4m3"), np.array([1000.0, -1000.0], np.float32))
    assert np.isnan(got).all()
    assert torch.tensor([1000.0]).to(torch.float8_e4m3fn).float().item() == 448.0


def test_float_to_int_truncates_toward_zero(run_op, assert_close):
    x = np.array([2.7, -2.7, 0.5, -0.5, 1e5], np.float32)
    got = run_op(lambda t: ops.cast(t, "i32"), x)
    assert_close("cast", got, torch.from_numpy(x).to(torch.int32).double())


# ---- FP8 ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["f8e4m3", "f8e5m2"])
@pytest.mark.parametrize("scale_shape", [(), (1,), (5,), (5, 1)])
def test_dequant_fp8(fmt, scale_shape, run_op, assert_close, rng):
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(TORCH[fmt])
    scale = torch.rand(scale_shape, generator=torch.Generator().manual_seed(1)) + 0.1
    w_np = w.view(torch.uint8).numpy().view(DType(fmt).np)
    got = run_op(ops.dequant_fp8, w_np, scale.numpy())
    per_row = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    assert_close("quant", got, w.double() * per_row.double())


def test_dequant_fp8_to_bf16(run_op, assert_close, rng):
    w = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0, 0.125])
    got = run_op(
        lambda a, s: ops.dequant_fp8(a, s, dtype="bf16"),
        w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
        scale.numpy(),
    )
    # fp8 values times powers of two are exact in bf16
    assert_close("quant", got, (w.float() * scale[:, None]).to(torch.bfloat16).double())


def test_dequant_fp8_rejects_a_mismatched_scale(run_op):
    w = np.zeros((4, 8), ml_dtypes.float8_e4m3fn)
    with pytest.raises(QuantizationError, match=r"per-channel \(\[4\] / \[4, 1\]\)"):
        run_op(ops.dequant_fp8, w, np.ones(8, np.float32))


# ---- NVFP4 -------------------------------------------------------------------------------------------------
# E2M1 magnitudes for codes 0..7; bit 3 is the sign (OCP MX spec; NVIDIA ModelOpt).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    magnitude = E2M1[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor, low_first: bool) -> torch.Tensor:
    first, second = codes[:, 0::2], codes[:, 1::2]
    return (first | (second << 4)) if low_first else ((first << 4) | second)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS 128x4 block-scale layout (torchao / comfy-kitchen ``to_blocked``), as a padded 2-D tensor."""
    rows, cols = scales.shape
    n_row_blocks, n_col_blocks = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(n_row_blocks * 128, n_col_blocks * 4, dtype=scales.dtype)
    padded[:rows, :cols] = scales
    blocks = padded.view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3)
    rearranged = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return rearranged.flatten().reshape(n_row_blocks * 128, n_col_blocks * 4)


def _nvfp4_case(out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // 16, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.37)
    dense = e2m1_decode(codes.long()).double() * scales.double().repeat_interleave(16, 1) * scale_2.double()
    return codes, scales, scale_2, dense


def _fp8_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 16), (5, 32), (17, 48), (130, 80)])
def test_dequant_nvfp4_modelopt(out_features, in_features, run_op, assert_close):
    codes, scales, scale_2, dense = _nvfp4_case(out_features, in_features, seed=out_features)
    packed = pack_nibbles(codes, low_first=True).numpy()
    got = run_op(
        lambda w, s, s2: ops.dequant_nvfp4(w, s, s2, out_features, in_features, "modelopt"),
        packed,
        _fp8_numpy(scales),
        scale_2.numpy(),
    )
    assert_close("quant", got, dense)


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 16), (5, 32), (17, 48), (130, 80)])
def test_dequant_nvfp4_comfy(out_features, in_features, run_op, assert_close):
    codes, scales, scale_2, dense = _nvfp4_case(out_features, in_features, seed=out_features + 1)
    pad_rows, pad_cols = -(-out_features // 16) * 16, -(-in_features // 16) * 16
    padded = torch.zeros(pad_rows, pad_cols, dtype=torch.uint8)
    padded[:out_features, :in_features] = codes
    packed = pack_nibbles(padded, low_first=False).numpy()
    blocked = to_blocked(scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    got = run_op(
        lambda w, s, s2: ops.dequant_nvfp4(w, s, s2, out_features, in_features, "comfy"),
        packed,
        _fp8_numpy(blocked),
        scale_2.reshape(1).numpy(),
    )
    assert_close("quant", got, dense)


@pytest.mark.parametrize(("layout", "expected"), [("modelopt", [1.0, 0.5]), ("comfy", [0.5, 1.0])])
def test_nvfp4_nibble_order(layout, expected, run_op):
    """Byte 0x12 holds codes 2 (+1.0, low nibble) and 1 (+0.5, high nibble): element 0 is the low nibble in
    the ModelOpt layout and the high nibble in ComfyUI's."""
    rows, cols = (1, 8) if layout == "modelopt" else (16, 8)
    packed = np.zeros((rows, cols), np.uint8)
    packed[0, 0] = 0x12
    scale_rows, scale_cols = (1, 1) if layout == "modelopt" else (128, 4)
    scales = np.zeros((scale_rows, scale_cols), ml_dtypes.float8_e4m3fn)
    scales[0, 0] = 1.0  # logical (0, 0) sits at stored (0, 0) in both layouts
    got = run_op(
        lambda w, s, s2: ops.dequant_nvfp4(w, s, s2, 1, 16, layout),
        packed,
        scales,
        np.float32(1.0).reshape(()),
    )
    assert got[0, :2].tolist() == expected
    assert not got[0, 2:].any()


def test_unswizzle_inverts_to_blocked(run_op):
    logical = torch.arange(130 * 9, dtype=torch.float32).reshape(130, 9)
    stored = to_blocked(logical).numpy()
    got = run_op(lambda s: ops.unswizzle_scales(s, 130, 9), stored)
    assert np.array_equal(got, logical.numpy())


def test_dequant_nvfp4_rejects_a_dense_matrix(run_op):
    """A packed [N, K/2] weight must never be read as anything but u8 pairs of codes."""
    with pytest.raises(QuantizationError, match="u8"):
        run_op(
            lambda w, s, s2: ops.dequant_nvfp4(w, s, s2, 4, 32, "modelopt"),
            np.zeros((4, 16), np.float32),
            np.zeros((4, 2), ml_dtypes.float8_e4m3fn),
            np.float32(1).reshape(()),
        )
    with pytest.raises(QuantizationError, match=r"expected \(4, 16\)"):
        run_op(
            lambda w, s, s2: ops.dequant_nvfp4(w, s, s2, 4, 32, "modelopt"),
            np.zeros((4, 32), np.uint8),
            np.zeros((4, 2), ml_dtypes.float8_e4m3fn),
            np.float32(1).reshape(()),
        )
