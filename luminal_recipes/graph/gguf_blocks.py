"""GGUF (ggml) block-quantized weights: the block layouts and their decoding, in numpy.

A quantized GGUF tensor of logical shape ``[N, K]`` is stored as ``N`` rows of ``K / block_size`` blocks of
``type_size`` bytes each; the graph keeps those bytes packed (``u8 [N, K / block_size * type_size]``) and decodes
them with the ``Dequant`` primitive (``graph.core.dequant``). This module is that primitive's definition: the one
place that knows the layouts (llama.cpp's ``ggml-common.h``), used by the reference interpreter and by the numpy
runtime; every other implementation (numba, CUDA) is tested bit for bit against it, and it is tested bit for bit
against ``gguf.quants.dequantize`` (llama.cpp's own gguf-py).

Every value is computed in f32 with the products in the order ``gguf.quants`` uses (e.g. Q4_K: ``(d * sc) * q -
(dmin * m)``), so the results are identical, not merely close.
"""

from __future__ import annotations

import numpy as np

QK_K = 256

# name -> (ggml type id, elements per block, bytes per block)
QTYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q2_K": (10, QK_K, 84), "Q3_K": (11, QK_K, 110), "Q4_K": (12, QK_K, 144), "Q5_K": (13, QK_K, 176),
    "Q6_K": (14, QK_K, 210), "IQ4_NL": (20, 32, 18), "IQ4_XS": (23, QK_K, 136),
}
BY_ID = {tid: name for name, (tid, _, _) in QTYPES.items()}
# byte offsets of the f16 scales (d, and dmin or m) inside a block of each quantized type
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# IQ4_NL / IQ4_XS: the 4-bit codes index this non-linear table (ggml-common.h's kvalues_iq4nl)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def block_size(qtype: str) -> int:
    return QTYPES[qtype][1]


def type_size(qtype: str) -> int:
    return QTYPES[qtype][2]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one packed row of ``k`` elements (``k`` a multiple of the block size)."""
    _, bs, ts = QTYPES[qtype]
    if k % bs:
        raise ValueError(f"{qtype} rows need a multiple of {bs} elements, got {k}")
    return k // bs * ts


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """Low nibbles of each ``width``-byte group, then its high nibbles (ggml's order)."""
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(n, -1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of the little-endian u32 ``qh`` for element i of a 32-element block."""
    bits = qh.reshape(n, 4, 1) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8)
    return (bits & np.uint8(1)).reshape(n, 32)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins packed in 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K: the sixteen 6-bit signed scales packed in 12 bytes, as f32 (minus 32)."""
    n = scales.shape[0]
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = (lo & np.uint8(15)) | ((hi & np.uint8(3)) << np.uint8(4))
    return (sc.astype(np.int8) - np.int8(32)).astype(np.float32)


def iq4_xs_scales(scales: np.ndarray) -> np.ndarray:
    """IQ4_XS: the eight 6-bit sub-block scales (``scales_h`` u16 then ``scales_l`` 4 bytes), as f32 (minus 32)."""
    n = scales.shape[0]
    hi = np.ascontiguousarray(scales[:, :2]).view(np.uint16).reshape(n, 1) >> (2 * np.arange(8, dtype=np.uint16))
    lo = (scales[:, 2:6].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8)
    sc = (lo & np.uint8(15)) | ((hi.astype(np.uint8) & np.uint8(3)) << np.uint8(4))
    return (sc.astype(np.int8) - np.int8(32)).astype(np.float32)


def _decode_blocks(qtype: str, b: np.ndarray) -> np.ndarray:
    """``b`` u8 [n, type_size] -> f32 [n, block_size]."""
    n = b.shape[0]
    if qtype == "F32":
        return np.ascontiguousarray(b).view(np.float32)
    if qtype == "F16":
        return _f16(b)
    if qtype == "BF16":
        return (np.ascontiguousarray(b).view(np.int16).astype(np.int32) << 16).view(np.float32)
    if qtype == "Q8_0":
        return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32) * _f16(b[:, :2])
    if qtype == "Q4_0":
        q = _nibbles(b[:, 2:], n, 16).astype(np.int8) - np.int8(8)
        return _f16(b[:, :2]) * q.astype(np.float32)
    if qtype == "Q4_1":
        q = _nibbles(b[:, 4:], n, 16).astype(np.float32)
        return (_f16(b[:, :2]) * q) + _f16(b[:, 2:4])
    if qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        q5 = _nibbles(b[:, off + 4:], n, 16) | (_high_bits(b[:, off:off + 4], n) << np.uint8(4))
        if qtype == "Q5_0":
            return _f16(b[:, :2]) * (q5.astype(np.int8) - np.int8(16)).astype(np.float32)
        return (_f16(b[:, :2]) * q5.astype(np.float32)) + _f16(b[:, 2:4])
    if qtype == "Q2_K":
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        dl = (d * (scales & 0xF).astype(np.float32)).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
        q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        return (dl * q.reshape(n, 16, 16).astype(np.float32) - ml).reshape(n, QK_K)
    if qtype == "Q3_K":
        hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
        d = _f16(b[:, 108:110])
        dl = (d * q3_k_scales(scales)).reshape(n, 16, 1)
        ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
        qh = hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        ql = ql.reshape(n, 16, 16) & np.uint8(3)
        qh = (qh.reshape(n, 16, 16) & np.uint8(1)) ^ np.uint8(1)
        q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
        return (dl * q).reshape(n, QK_K)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = k_scale_min(b[:, 4:16])
        dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
        ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
        if qtype == "Q4_K":
            q = _nibbles(b[:, 16:], n, 32)
        else:
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = _nibbles(b[:, 48:], n, 32) | ((qh & np.uint8(1)).reshape(n, QK_K) << np.uint8(4))
        return (dl * q.reshape(n, 8, 32).astype(np.float32) - ml).reshape(n, QK_K)
    if qtype == "Q6_K":
        ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
        d = _f16(b[:, 208:210])
        dl = (d * np.ascontiguousarray(scales).view(np.int8).astype(np.float32)).reshape(n, 16, 1)
        lo = _nibbles(ql, n, 64).reshape(n, -1, 32)
        hi = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
              & np.uint8(3)).reshape(n, -1, 32)
        q = ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
        return (dl * q).reshape(n, QK_K)
    if qtype == "IQ4_NL":  # d, 16 bytes of table indices (low nibbles first)
        return _f16(b[:, :2]) * KVALUES_IQ4NL[_nibbles(b[:, 2:], n, 16)].astype(np.float32)
    if qtype == "IQ4_XS":  # d, scales_h (u16: 2 bits per sub-block), scales_l (4 bytes: 4 bits), 8 x 16 bytes
        dl = (_f16(b[:, :2]) * iq4_xs_scales(b[:, 2:8])).reshape(n, 8, 1)
        q = KVALUES_IQ4NL[_nibbles(b[:, 8:], n, 16)].astype(np.float32)
        return (dl * q.reshape(n, 8, 32)).reshape(n, QK_K)
    raise ValueError(f"unknown GGUF quantization type {qtype!r}; known: {', '.join(QTYPES)}")


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """``raw`` u8 [..., row_bytes] (whole blocks per row) -> f32 [..., K]."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"packed {qtype} data must be u8 bytes, got {raw.dtype}")
    _, bs, ts = QTYPES[qtype]
    if raw.shape[-1] % ts:
        raise ValueError(f"{qtype} rows of {raw.shape[-1]} bytes are not whole {ts}-byte blocks")
    lead = raw.shape[:-1]
    k = raw.shape[-1] // ts * bs
    blocks = np.ascontiguousarray(raw).reshape(-1, ts)
    if blocks.shape[0] == 0:
        return np.zeros(lead + (k,), np.float32)
    with np.errstate(all="ignore"):  # a scale that is inf or NaN decodes as it does in gguf-py
        return _decode_blocks(qtype, blocks).reshape(lead + (k,))
