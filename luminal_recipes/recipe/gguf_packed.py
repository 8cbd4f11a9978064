"""GGUF weights kept packed: a recipe weight read from one block-quantized (or f16/bf16) tensor of a GGUF file
becomes a ``u8`` graph weight holding the file's bytes (memory-mapped) and a ``Dequant`` node
(``graph.gguf_blocks``); the compiler's rules (``compiler/rules/gguf.egg``) then fuse it into the products that
read it (``DequantMatMulGGUF``) and the embedding lookups (``GatherDequant``), so the dense weight never exists.

A part of a tensor split by rows (FLUX.2's packed QKV, ``weights.split`` along axis 0) is kept packed too: its rows
of blocks are a slice of the stored bytes. Weights the reader must transform (GPT-2's transposed matrices, Gemma's
norm offsets), parts split along another axis and weights with LoRA updates merged into them are decoded at load
as before (``GgufCheckpoint.load``); so is every weight with ``LUMINAL_RECIPES_GGUF=dense`` in the environment
(the dequantize-at-load path, for comparisons).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..graph import DType, Graph, Tensor, dequant, gguf_blocks, to_dtype

PACKED_PLAIN = ("F16", "BF16")  # plain types also read through Dequant (no f32 copy of the weight)


def packed_mode() -> bool:
    return os.environ.get("LUMINAL_RECIPES_GGUF", "packed") != "dense"


def packed_weight(graph: Graph, checkpoint: Any, stored: Any, name: str, compute: str,
                  bind: Callable[[str, tuple[int, ...], DType, Callable[[], np.ndarray], tuple[str, ...]], None]
                  ) -> Tensor | None:
    """``dequant(u8 weight)`` for the recipe weight ``name`` mapped from ``stored`` (a ``MappedTensor``), or None
    when it is not one whole packable GGUF tensor (the caller then reads it densely). ``bind`` records the u8
    graph weight's loader."""
    records = getattr(checkpoint, "records", None)
    if records is None or stored is None or len(stored.sources) != 1 or not packed_mode():
        return None
    record = records.get(stored.sources[0])
    if record is None or record.type_name not in gguf_blocks.QTYPES:
        return None
    if not (record.quantized or record.type_name in PACKED_PLAIN):
        return None
    rows = getattr(stored, "rows", None)
    start, stop = rows if rows is not None else (0, record.shape[0])
    if len(record.shape) != 2 or tuple(stored.shape) != (stop - start, record.shape[1]) or \
            tuple(record.stored_shape) != tuple(record.shape) or record.ops not in ((), ("unpermute",)) or \
            (rows is not None and record.ops):
        return None
    raw = np.asarray(record.raw)
    rb = gguf_blocks.row_bytes(record.type_name, record.shape[1])
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    raw = raw.reshape(record.shape[0], rb)[start:stop]  # a split part: its rows of blocks, still a view of the map
    order = record.row_order if "unpermute" in record.ops else None

    def load() -> np.ndarray:
        # the rows of q/k projections reordered as the converter permuted them (a copy of packed bytes)
        return checkpoint.reordered_rows(raw, order) if order is not None else raw

    bind(name, raw.shape, DType.U8, load, tuple(stored.sources))
    weight = graph.weight(name, raw.shape, DType.U8)
    return dequant(weight, record.type_name, to_dtype(compute))


def per_use(t: Tensor) -> Tensor:
    """A new ``Dequant`` node for each use of a packed weight (the bytes stay one weight): a weight used in two
    places (a tied LM head reads the embedding table) is then decoded beside each reader, so the compiler fuses
    each use with its reader even when the two sit in different segments of the graph."""
    node = t.graph.nodes[t.node]
    if node.op != "Dequant":
        return t
    src = t.graph.nodes[node.inputs[0][0]]
    if src.op != "Input":
        return t
    return dequant(t.graph.tensor(src.name), node.attr("qtype"), node.dtype)


def check_gguf_source(quant: Any, checkpoint: Any, where: str) -> None:
    """A model whose quantization block says ``format: gguf`` reads a GGUF file of its ``architecture``: anything
    else is refused before any weight is read, naming ``where`` (the recipe line of the block) and the file."""
    found = getattr(checkpoint, "architecture", None)
    if getattr(checkpoint, "records", None) is None or found is None:
        raise CheckpointError(
            f"{where}: quantization format gguf (architecture {quant.architecture}) needs a GGUF file, but the "
            f"checkpoint is {getattr(checkpoint, 'root', checkpoint)} (not GGUF); put the .gguf file (and its "
            f"config.json) in the model's folder, or use the recipe for that checkpoint format.")
    if found != quant.architecture:
        raise CheckpointError(
            f"{where}: the GGUF file {checkpoint.root} has general.architecture '{found}', but this model reads "
            f"'{quant.architecture}' files; give this recipe a {quant.architecture} GGUF file, or run the file with "
            f"a recipe of its architecture.")
