"""Low-precision formats against independent references: ml_dtypes, PyTorch's float8_e4m3fn, the
byte-level decoders in the seed (quant.rs, lines 14742-14960), and ModelOpt's NVFP4 math re-derived in
torch."""

import ml_dtypes
import numpy as np
import pytest
import torch

from luminal_recipes.errors import QuantizationError
from luminal_recipes.weights import formats as F

# --- references written from the published math (not from the code under test) ------------------------------
# The seed's FP4 table and FP8 E4M3 bit decoder (quant.rs), transcribed.
SEED_FP4_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def seed_fp8_e4m3_to_f32(byte: int) -> float:
    sign, exp, mant = (byte >> 7) & 1, (byte >> 3) & 0xF, byte & 7
    value = (mant / 8.0) * 2.0**-6 if exp == 0 else (1.0 + mant / 8.0) * 2.0 ** (exp - 7)
    return -value if sign else value


E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def ref_cast_fp4(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``_cast_fp4``: searchsorted over the midpoints, ties at odd midpoints pushed up (RNE)."""
    a = x.abs().contiguous()
    ordinal = torch.searchsorted(E2M1_BOUNDS, a).to(torch.uint8)
    at_odd_bound = (a.unsqueeze(-1) == E2M1_BOUNDS[[1, 3, 5]]).any(-1).to(torch.uint8)
    return ((x < 0).to(torch.uint8) << 3) + ordinal + at_odd_bound


def ref_nvfp4_modelopt(w: torch.Tensor):
    """NVFP4 per ModelOpt's NVFP4QTensor: (packed low-nibble-first U8, fp8 block scales, f32 scale_2)."""
    n, k = w.shape
    scale_2 = w.abs().amax().float() / (6.0 * 448.0)
    blocks = w.float().view(n, k // 16, 16)
    scale = blocks.abs().amax(-1) / (6.0 * scale_2)
    scale[scale == 0] = 1.0
    scale_fp8 = scale.to(torch.float8_e4m3fn)
    scaled = (blocks / (scale_fp8.float() * scale_2).unsqueeze(-1)).view(n, k)
    codes = ref_cast_fp4(scaled)
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed, scale_fp8, scale_2


def ref_to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen / torchao ``to_blocked`` (cuBLAS 128x4 scale tiles), stored 2-D as ComfyUI does."""
    rows, cols = scales.shape
    nrb, ncb = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(nrb * 128, ncb * 4, dtype=scales.dtype)
    padded[:rows, :cols] = scales
    blocks = padded.view(nrb, 128, ncb, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).reshape(nrb * 128, ncb * 4)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian weights with heavy-tailed outliers (so block scales span the fp8 range) and one zero block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.rand(n, k, generator=g) < 0.01] *= 300.0
    w[0, :16] = 0.0
    return w


# --- E2M1 and FP8 decoding ----------------------------------------------------------------------------------
def test_e2m1_table_matches_ml_dtypes_and_seed():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        F.decode_e2m1(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    )
    np.testing.assert_array_equal(F.decode_e2m1(codes), np.array(SEED_FP4_LUT, dtype=np.float32))
    assert np.signbit(F.decode_e2m1(np.uint8(8)))  # code 8 is -0.0, as in the seed


def test_fp8_decode_matches_seed_bit_decoder_and_torch():
    raw = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # 0x7F/0xFF are NaN
    ours = F.dequantize_fp8(raw.view(ml_dtypes.float8_e4m3fn), 1.0)
    seed = np.array([seed_fp8_e4m3_to_f32(int(b)) for b in raw], dtype=np.float32)
    torch_values = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ours, seed)
    np.testing.assert_array_equal(ours, torch_values)
    # the seed's own test values
    assert [seed_fp8_e4m3_to_f32(b) for b in (0x38, 0x40, 0x3C)] == [1.0, 2.0, 1.5]


def test_e2m1_rounding_matches_modelopt_including_ties_and_saturation():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
    specials = [0.0, -0.0, 6.0, -6.0, 6.5, -7.0, 1e6, -1e6, 0.1, -0.1, 5.9999]
    x = torch.cat([torch.tensor(ties + specials), torch.randn(4096) * 4])
    np.testing.assert_array_equal(F.encode_e2m1(x.numpy()), ref_cast_fp4(x).numpy())


# --- nibble packing -----------------------------------------------------------------------------------------
def test_seed_byte_0x12_in_both_nibble_orders():
    # quant.rs: byte 0x12 -> low nibble 2 (+1.0), high nibble 1 (+0.5); with block scale 2.0 and outer scale
    # 0.5 the elements come out as +1.0 and +0.5.
    byte = np.array([[0x12]], dtype=np.uint8)
    assert F.decode_e2m1(F.unpack_fp4(byte, "low_first")).tolist() == [[1.0, 0.5]]
    assert F.decode_e2m1(F.unpack_fp4(byte, "high_first")).tolist() == [[0.5, 1.0]]
    packed = np.full((1, 8), 0x12, dtype=np.uint8)
    scale = np.array([[2.0]], dtype=ml_dtypes.float8_e4m3fn)
    modelopt = F.dequantize_nvfp4(packed, scale, np.float32(0.5), "modelopt")
    assert modelopt[0, :2].tolist() == [1.0, 0.5]
    assert F.pack_fp4(np.array([[2, 1]]), "low_first").tolist() == [[0x12]]
    assert F.pack_fp4(np.array([[1, 2]]), "high_first").tolist() == [[0x12]]


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_pack_unpack_round_trip(order):
    codes = np.random.default_rng(0).integers(0, 16, size=(7, 34), dtype=np.uint8)
    packed = F.pack_fp4(codes, order)
    assert packed.shape == (7, 17)
    np.testing.assert_array_equal(F.unpack_fp4(packed, order), codes)


def test_nibble_orders_differ_by_a_nibble_swap():
    codes = np.random.default_rng(1).integers(0, 16, size=(5, 32), dtype=np.uint8)
    low, high = F.pack_fp4(codes, "low_first"), F.pack_fp4(codes, "high_first")
    np.testing.assert_array_equal(high, (low << 4) | (low >> 4))
    with pytest.raises(QuantizationError, match="even"):
        F.pack_fp4(codes[:, :3])


# --- 128x4 swizzle ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (1, 1), (130, 5), (96, 12), (300, 17)])
def test_swizzle_matches_to_blocked_and_round_trips(rows, cols):
    scales = np.random.default_rng(rows * cols).integers(1, 255, size=(rows, cols), dtype=np.uint8)
    swizzled = F.swizzle_block_scales(scales)
    assert swizzled.shape == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    np.testing.assert_array_equal(swizzled, ref_to_blocked(torch.from_numpy(scales)).numpy())
    np.testing.assert_array_equal(F.unswizzle_block_scales(swizzled, rows, cols), scales)


def test_swizzle_places_each_scale_where_cublas_documents():
    # cuBLAS block-scaling-factor layout: tiles of 128 rows x 4 cols (512 bytes) in row-major tile order;
    # inside a tile, (r, c) is at byte (r % 32) * 16 + (r // 32) * 4 + c.
    rows, cols = 256, 8
    scales = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    flat = F.swizzle_block_scales(scales).reshape(-1)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (cols // 4) + c // 4
            rr = r % 128
            assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4] == scales[r, c]


# --- NVFP4 quantization -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (48, 32), (300, 1024)])
def test_nvfp4_modelopt_is_bit_exact_with_the_reference(shape, dtype):
    w = _weights(*shape, seed=shape[0]).to(dtype)
    packed, scale, scale_2 = ref_nvfp4_modelopt(w)
    source = w.float().numpy() if dtype == torch.float32 else _u8(w).view(ml_dtypes.bfloat16).reshape(shape)
    q = F.quantize_nvfp4(source, "modelopt")
    np.testing.assert_array_equal(q.weight, packed.numpy())
    np.testing.assert_array_equal(q.weight_scale.view(np.uint8), _u8(scale))
    assert q.weight_scale_2.dtype == np.float32 and q.weight_scale_2.shape == ()
    assert q.weight_scale_2.tobytes() == scale_2.numpy().tobytes()
    # dequantization as ModelOpt writes it: e2m1 * (fp8 scale * scale_2), in f32
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(shape).long()
    ref_dense = torch.tensor(SEED_FP4_LUT)[codes].view(shape[0], -1, 16) * (
        scale.float() * scale_2
    ).unsqueeze(-1)
    dense = F.dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, "modelopt")
    np.testing.assert_array_equal(dense, ref_dense.reshape(shape).numpy())


def test_nvfp4_error_is_within_the_format_bound():
    w = _weights(256, 512, seed=7).numpy()
    q = F.quantize_nvfp4(w)
    dense = F.dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    total = (q.weight_scale.astype(np.float32) * q.weight_scale_2)[..., None]  # per block
    blocks, err = w.reshape(256, 32, 16), np.abs(dense - w).reshape(256, 32, 16)
    scaled = np.abs(blocks) / total
    half_step = np.where(scaled < 2, 0.25, np.where(scaled < 4, 0.5, 1.0))
    # saturation: only where the fp8 scale rounded far down (subnormal scales)
    saturation = np.maximum(np.abs(blocks) - 6 * total, 0)
    assert np.all(err <= half_step * total * (1 + 2**-20) + saturation)
    # per-block relative error where the fp8 scale is a normal number: half the largest E2M1 step (1.0) at a
    # scale at most 2^-4 above block_amax / 6
    normal = (q.weight_scale.astype(np.float32) >= 2.0**-6) & (np.abs(blocks).max(-1) > 0)
    rel = err.max(-1)[normal] / np.abs(blocks).max(-1)[normal]
    assert rel.max() <= (1 + 2**-4) / 6
    assert np.all(dense.reshape(256, 32, 16)[0, 0] == 0)  # the all-zero block


def test_comfy_layout_is_the_same_math_high_nibble_first_and_swizzled():
    w = _weights(256, 128, seed=3).numpy()
    modelopt, comfy = F.quantize_nvfp4(w, "modelopt"), F.quantize_nvfp4(w, "comfy")
    codes = F.unpack_fp4(modelopt.weight, "low_first")
    np.testing.assert_array_equal(comfy.weight, F.pack_fp4(codes, "high_first"))
    np.testing.assert_array_equal(comfy.weight_scale, F.swizzle_block_scales(modelopt.weight_scale))
    np.testing.assert_array_equal(
        F.dequantize_nvfp4(comfy.weight, comfy.weight_scale, comfy.weight_scale_2, "comfy"),
        F.dequantize_nvfp4(modelopt.weight, modelopt.weight_scale, modelopt.weight_scale_2, "modelopt"),
    )


def test_comfy_layout_pads_to_16_and_128x4():
    w = _weights(20, 40, seed=5)
    comfy = F.quantize_nvfp4(w.numpy(), "comfy")
    assert comfy.weight.shape == (32, 24)  # [pad16(20), pad16(40) / 2]
    assert comfy.weight_scale.shape == (128, 4)  # [pad128(32), pad4(48 / 16)]
    padded = torch.zeros(32, 48)
    padded[:20, :40] = w
    packed, scale, _ = ref_nvfp4_modelopt(padded)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(32, 48)
    np.testing.assert_array_equal(comfy.weight, ((codes[:, 0::2] << 4) | codes[:, 1::2]).numpy())
    np.testing.assert_array_equal(comfy.weight_scale.view(np.uint8), _u8(ref_to_blocked(scale)))
    dense = F.dequantize_nvfp4(
        comfy.weight, comfy.weight_scale, comfy.weight_scale_2, "comfy", shape=(20, 40)
    )
    assert dense.shape == (20, 40)
    assert F.COMFY.weight_shape(20, 40) == (32, 24) and F.COMFY.scale_shape(20, 40) == (128, 4)
    assert F.MODELOPT.weight_shape(20, 48) == (20, 24) and F.MODELOPT.scale_shape(20, 48) == (20, 3)


def test_nvfp4_rejects_bad_input():
    with pytest.raises(QuantizationError, match="multiple of 16"):
        F.quantize_nvfp4(np.ones((4, 40), np.float32), "modelopt")
    with pytest.raises(QuantizationError, match="NaN"):
        F.quantize_nvfp4(np.full((4, 16), np.nan, np.float32))
    with pytest.raises(QuantizationError, match="unknown NVFP4 layout"):
        F.nvfp4_layout("cutlass")
    q = F.quantize_nvfp4(np.ones((200, 64), np.float32), "comfy")  # scales padded to [256, 4]
    with pytest.raises(QuantizationError, match="comfy layout"):
        F.dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, "modelopt")


# --- FP8 ----------------------------------------------------------------------------------------------------
def test_fp8_per_tensor_matches_torch_and_precision():
    w = _weights(64, 96, seed=11)
    q, scale = F.quantize_fp8(w.numpy(), "per_tensor")
    ref_scale = w.abs().amax() / 448.0
    ref_q = (w / ref_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert scale.shape == () and scale.tobytes() == ref_scale.numpy().tobytes()
    np.testing.assert_array_equal(q.view(np.uint8), _u8(ref_q))
    err = np.abs(F.dequantize_fp8(q, scale) - w.numpy())
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 in the normal range, absolute <= 2^-10 * scale below it
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(w.numpy()), 2.0**-10 * scale) * (1 + 2**-20))


def test_fp8_per_channel():
    w = _weights(32, 48, seed=13)
    w[5] = 0.0
    q, scale = F.quantize_fp8(w.numpy(), "per_channel")
    assert scale.shape == (32,) and scale[5] == 1.0
    ref_scale = (w.abs().amax(1) / 448.0).numpy()
    np.testing.assert_array_equal(np.delete(scale, 5), np.delete(ref_scale, 5))
    err = np.abs(F.dequantize_fp8(q, scale) - w.numpy())
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(w.numpy()), 2.0**-10 * scale[:, None]) * (1 + 2**-20))
    np.testing.assert_array_equal(F.dequantize_fp8(q, scale[:, None]), F.dequantize_fp8(q, scale))
    with pytest.raises(QuantizationError, match="per output channel"):
        F.dequantize_fp8(q, np.ones(7, np.float32))


def test_comfy_legacy_fp8_names():
    names = {
        "model.diffusion_model.scaled_fp8",
        "model.diffusion_model.a.weight",
        "model.diffusion_model.a.scale_weight",
        "model.diffusion_model.a.scale_input",
        "vae.b.scale_weight",
    }
    renames, marker = F.comfy_legacy_fp8_renames(names)
    assert marker == "model.diffusion_model.scaled_fp8"
    assert renames == {
        "model.diffusion_model.a.scale_weight": "model.diffusion_model.a.weight_scale",
        "model.diffusion_model.a.scale_input": "model.diffusion_model.a.input_scale",
    }
    assert F.comfy_legacy_fp8_renames({"a.weight", "a.weight_scale"}) == ({}, None)
