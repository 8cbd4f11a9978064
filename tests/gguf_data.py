"""Packed GGUF test data (a plain module shared by the graph and runtime tests): random blocks whose f16 scales
are finite (or chosen edge values), in every type of ``graph.gguf_blocks``."""

from __future__ import annotations

import numpy as np

from luminal_recipes.graph import gguf_blocks

# f16 bit patterns of edge scales: +-0, the smallest subnormal, the largest subnormal, the smallest normal, 1, the
# largest finite (+-), and a negative normal
EDGE_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0xB555], np.uint16)


def packed(rng: np.random.Generator, qtype: str, rows: int, blocks: int, edge: bool = False) -> np.ndarray:
    """u8 [rows, blocks * type_size]: random bytes, the scales finite f16 values (normal ones around 0.01, or the
    edge values when ``edge``); float types hold random values."""
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    if bs == 1:
        values = rng.standard_normal((rows, blocks * 32)).astype(np.float32)
        if qtype == "F32":
            return values.view(np.uint8)
        if qtype == "F16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, blocks, ts), dtype=np.uint8)
    for off in gguf_blocks.SCALE_OFFSETS[qtype]:
        if edge:
            scales = rng.choice(EDGE_SCALES, (rows, blocks))
        else:
            scales = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16).view(np.uint16)
        raw[:, :, off:off + 2] = scales.astype(np.uint16).view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * ts)


def elements(qtype: str, blocks: int) -> int:
    _, bs, _ = gguf_blocks.QTYPES[qtype]
    return blocks * (32 if bs == 1 else bs)
