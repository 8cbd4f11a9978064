"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package (llama.cpp's own reader).

A GGUF file holds a model's configuration and tokenizer as metadata and its tensors under llama.cpp's names
(``blk.0.attn_q.weight``), many of them quantized in blocks (Q4_1, Q4_K...). :class:`GgufCheckpoint` presents
one as the recipes see a transformers checkpoint: ``config`` is the config.json transformers' GGUF integration
would build from the metadata, tensors carry transformers' names (``model.layers.0.self_attn.q_proj.weight``), so
a recipe's own ``weights:`` rules apply unchanged, and ``load(name)`` returns the tensor with llama.cpp's
converter undone (q/k rows un-permuted, GPT-2's Conv1D weights transposed back, Gemma's ``w + 1`` norms). How
each architecture maps is data: ``gguf_architectures.yaml`` beside this file, never per-model code.

Every metadata key that could change the output is honoured or refused (see the YAML's header); the tensor types
are checked before any work (IQ* but IQ4_NL/IQ4_XS, TQ* and types this reader does not dequantize are refused, naming
the tensor).
The file is opened through ``files.open_regular`` (a regular file, inside the fence of a checkpoint a recipe
names) and memory-mapped: nothing is read until a tensor is loaded. Quantized tensors are dequantized at load
with ``gguf.quants.dequantize``; :meth:`GgufCheckpoint.packed` gives, per tensor, the packed bytes as stored
(a read-only ``uint8`` view of the map), its ``GGMLQuantizationType`` and the logical shape, for a runtime that
keeps weights packed.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..files import open_regular
from ..graph.dtypes import DType
from .safetensors_io import TensorInfo, TensorMapping

SUFFIX = ".gguf"
ARCHITECTURES_FILE = Path(__file__).with_name("gguf_architectures.yaml")
# the types a GGUF tensor may have here: plain floats (memory-mapped as they are) and the block quantizations
# gguf.quants dequantizes and the packed path implements (IQ4_NL and IQ4_XS of the IQ types); the other IQ*, TQ* and
# the rest are refused before any work
PLAIN_TYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": DType.BF16}  # BF16: ml_dtypes, on use
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = (*PLAIN_TYPES, *QUANT_TYPES)


def _plain_dtype(name: str) -> np.dtype:
    """The numpy dtype a plain (not block-quantized) GGUF tensor is viewed as."""
    found = PLAIN_TYPES[name]
    return found.np if isinstance(found, DType) else found
# metadata the tokenizer module reads (luminal_recipes/text/gguf_tokenizer.py); prefixes of descriptive keys
DESCRIPTIVE_PREFIXES = ("general.",)
TOKENIZER_PREFIX = "tokenizer."


def import_gguf() -> Any:
    """The ``gguf`` package, imported without the optional ``mistral_common`` its ``__init__`` pulls in.

    ``gguf/__init__.py`` imports ``gguf.vocab``, which imports ``mistral_common`` where it is installed (for its
    ``MistralVocab``, used by llama.cpp's converter): about 450 modules (pydantic models, tiktoken, jsonschema, PIL)
    and 30 MiB of resident memory for a process that only reads a file (measured: 32.6 MiB vs 2.3 MiB for the
    import). Reading never uses the vocab classes, so ``mistral_common`` is hidden while gguf is first imported
    here (gguf then records it as not installed, as on a machine without it); a process that imported
    ``mistral_common`` or ``gguf`` before keeps it as it is."""
    found = sys.modules.get("gguf")
    if found is not None:
        return found
    hide = "mistral_common" not in sys.modules
    if hide:
        sys.modules["mistral_common"] = None  # an import of it raises ImportError, which gguf.vocab catches
    try:
        import gguf
    finally:
        if hide and "mistral_common" in sys.modules and sys.modules["mistral_common"] is None:
            del sys.modules["mistral_common"]
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix, as llama.cpp and transformers name them)."""
    return str(path).lower().endswith(SUFFIX)


@cache
def architectures() -> dict[str, dict]:
    """``gguf_architectures.yaml``: architecture -> its rules, tensor rename lists flattened."""
    import yaml

    data = yaml.safe_load(ARCHITECTURES_FILE.read_text(encoding="utf-8"))
    for spec in data.values():
        spec["tensors"] = _flatten(spec.get("tensors", []))
        spec["_rename"] = [(re.compile(rule["regex"]), rule["to"]) for rule in spec["tensors"]]
        spec["_transforms"] = [(re.compile(rule["regex"]), rule) for rule in spec.get("transforms", [])]
    return data


def _flatten(rules: list) -> list[dict]:
    out: list[dict] = []
    for rule in rules:
        out.extend(_flatten(rule) if isinstance(rule, list) else [rule])
    return out


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file, as a runtime that keeps quantized weights packed needs it.

    ``raw`` is the stored bytes, a read-only view of the file's map: ``uint8`` of shape ``[*rows, bytes per row]``
    for a block type (a row of ``shape[-1]`` values is ``shape[-1] // block`` blocks; blocks never span rows), or
    the values for a plain type. ``stored_shape`` is the tensor's shape in the file in torch order (rows first),
    ``shape`` the logical shape the recipe sees once ``ops`` are applied: ``("unpermute",)``: rows reordered by
    ``row_order`` (``raw[row_order]`` is the same on packed rows); ``("transpose",)``; ``("subtract_one",)``."""

    name: str  # the transformers name the recipe's rules start from
    gguf_name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    stored_shape: tuple[int, ...]
    raw: np.ndarray
    ops: tuple[str, ...] = ()
    row_order: np.ndarray | None = None

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def quantized(self) -> bool:
        return self.qtype.name not in PLAIN_TYPES


@dataclass
class GgufCheckpoint(TensorMapping):
    """A GGUF file seen as a checkpoint of transformers-named tensors (the :class:`Checkpoint` interface the
    recipe builder uses: ``root``, ``tensors``, ``load``, ``quantization_metadata``) plus its ``config``."""

    _what = "GGUF file"
    root: Path  # the .gguf file itself
    architecture: str
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    records: dict[str, GgufTensor]
    reader: Any = field(repr=False)
    file_metadata: dict = field(default_factory=dict)
    quantization_metadata: None = None
    legacy_fp8_marker: None = None
    index: None = None

    # construction ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> GgufCheckpoint:
        """The checkpoint of a .gguf file. The file is parsed once per process while it is unchanged (a run opens
        it for its config, its tensors and its tokenizer; gguf's reader takes seconds on a large vocabulary);
        every call checks the path as ``files.open_regular`` does (a regular file, inside its fence)."""
        path = Path(path).expanduser()
        if not os.path.lexists(path):
            raise CheckpointError(f"GGUF file {path} does not exist; check --weights or the recipe's weights source")
        with open_regular(path, "a GGUF checkpoint file", CheckpointError) as handle:
            st = os.fstat(handle.fileno())
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        found = _OPENED.get(key)
        if found is None or found.root != path:
            found = cls._from_reader(path, read_gguf(path))
            _OPENED.clear()  # one file at a time: a map per file opened in a long process would pile up
            _OPENED[key] = found
        beside = architectures()[found.architecture].get("config_beside")
        if beside:  # read on every open: the file beside may have changed since the GGUF was parsed
            found.config = _config_beside(path, beside, found.architecture)
        return found

    @classmethod
    def _from_reader(cls, path: Path, reader: Any) -> GgufCheckpoint:
        fields = reader.fields
        if "general.architecture" not in fields:
            raise CheckpointError(f"{path}: the GGUF metadata has no general.architecture, so what model it holds "
                                  f"is unknown; convert the model again with llama.cpp's convert_hf_to_gguf.py.")
        architecture = str(_value(fields["general.architecture"], path, "general.architecture"))
        specs = architectures()
        if architecture not in specs:
            raise CheckpointError(
                f"{path}: general.architecture is '{architecture}', which no recipe here reads from GGUF (GGUF "
                f"architectures implemented: {', '.join(sorted(specs))}); use the model's safetensors checkpoint "
                f"with its recipe, or a GGUF of one of these architectures.")
        spec = specs[architecture]
        _check_types(path, reader)
        names = [t.name for t in reader.tensors]
        for pattern, why in (spec.get("refuse_tensors") or {}).items():
            hit = next((n for n in names if re.fullmatch(pattern, n)), None)
            if hit is not None:
                raise CheckpointError(f"{path}: tensor '{hit}': {why}.")
        for pattern, why in (spec.get("requires_tensors") or {}).items():
            if not any(re.fullmatch(pattern, n) for n in names):
                raise CheckpointError(
                    f"{path}: general.architecture is '{architecture}' but the file has no tensor named like "
                    f"'{pattern}' ({why}); it holds {len(names)} tensors, e.g. "
                    f"{', '.join(repr(n) for n in names[:3])}.")
        config = _config(path, reader, architecture, spec, names)
        records: dict[str, GgufTensor] = {}
        infos: dict[str, TensorInfo] = {}
        size = reader.data.size
        for tensor in reader.tensors:
            name = _rename(tensor.name, spec)
            if name in records:
                raise CheckpointError(f"{path}: tensors '{records[name].gguf_name}' and '{tensor.name}' both map to "
                                      f"'{name}'; the file holds a tensor twice.")
            start = int(tensor.data_offset)
            end = start + int(tensor.n_bytes)
            if end > size or tensor.data.nbytes != tensor.n_bytes:
                raise CheckpointError(
                    f"{path}: tensor '{tensor.name}' ({tensor.tensor_type.name}, {int(tensor.n_bytes)} bytes at "
                    f"offset {start}) runs past the end of the file ({size} bytes): the file is truncated. Download "
                    f"or convert it again (compare its size with the source).")
            record = _record(path, name, tensor, spec, config)
            records[name] = record
            dtype = record.type_name if not record.quantized and "subtract_one" not in record.ops else "F32"
            infos[name] = TensorInfo(name, record.shape, dtype, path, start, end, tensor.name)
        return cls(path, architecture, config, infos, records, reader)

    # the mapping interface is TensorMapping's
    @property
    def files(self) -> list[Path]:
        return [self.root]

    @property
    def metadata(self) -> dict[str, str]:
        return {}

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value under ``key`` (strings, numbers, lists), or ``default``."""
        found = self.reader.fields.get(key)
        return default if found is None else _value(found, self.root, key)

    def metadata_keys(self) -> list[str]:
        return [k for k in self.reader.fields if not k.startswith("GGUF.")]

    # reading -----------------------------------------------------------------------------------------------
    def packed(self, name: str) -> GgufTensor:
        """The stored form of tensor ``name`` (a transformers name): packed bytes, type, logical shape."""
        try:
            return self.records[name]
        except KeyError:
            raise CheckpointError(f"tensor '{name}' is not in GGUF file {self.root}") from None

    def load(self, name: str) -> np.ndarray:
        """The tensor as the recipe expects it: plain types mapped from the file (zero-copy when no transform
        applies), block types dequantized by ``gguf.quants.dequantize``, then the converter's transforms undone."""
        dequantize = import_gguf().quants.dequantize
        record = self.packed(name)
        if not record.quantized and "subtract_one" not in record.ops:
            array = np.asarray(record.raw).view(_plain_dtype(record.type_name)).reshape(record.stored_shape)
        else:
            array = dequantize(np.asarray(record.raw), record.qtype).reshape(record.stored_shape)
        for op in record.ops:
            if op == "unpermute":
                array = array[record.row_order]
            elif op == "transpose":
                array = np.ascontiguousarray(array.T)
            elif op == "subtract_one":
                array = array - np.float32(1)
        return array

    def reordered_rows(self, raw: np.ndarray, order: np.ndarray) -> np.ndarray:
        """``raw[order]`` (packed rows of this file's map reordered: q/k projections un-permuted) as a copy, and
        the map's pages it was read from dropped from this process (``MADV_DONTNEED``: nothing reads them again;
        they stay in the page cache and a later read maps them back). Else they stay resident beside the copy, so
        the bytes count twice in the resident set: ~8 MiB of SmolLM2-135M's, ~110 MiB of a 1B Q8_0 file's."""
        out = np.ascontiguousarray(raw[order])
        out.flags.writeable = False  # a weight, as the file's own read-only pages are (the runtime's GGUF tiles
        # are kept per read-only buffer: runtimes/cpu/jit/gguf_tile_cache.py)
        _drop_pages(self.reader.data, raw)
        return out

    def close(self) -> None:
        """Nothing to release but the map, which arrays already handed out keep alive."""

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPENED: dict[tuple, GgufCheckpoint] = {}


# ---- reading the file ------------------------------------------------------------------------------------
def read_gguf(path: Path) -> Any:
    """``gguf.GGUFReader`` over the file opened as every checkpoint file is (``files.open_regular``), with string
    and number arrays held as few Python objects (``Reader._get_field_parts``); a damaged file is a located
    ``CheckpointError``. Every GGUF read goes through here (``GgufCheckpoint.open``, ``recipe/choose.py``)."""
    gguf = import_gguf()
    GGMLQuantizationType, GGUFReader = gguf.GGMLQuantizationType, gguf.GGUFReader

    class Reader(GGUFReader):
        """gguf's reader, stopping at a tensor whose type gguf does not know with a message naming the tensor
        (gguf's own error names only the number)."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            known = {int(t) for t in GGMLQuantizationType}
            for info in fields:
                raw = int(info.parts[4][0])
                if raw not in known:
                    name = bytes(info.parts[1]).decode("utf-8", "replace")
                    raise CheckpointError(
                        f"{path}: tensor '{name}' is stored in ggml type {raw}, which the gguf package "
                        f"{_gguf_version()} does not know (a newer llama.cpp type, or a corrupt file); implemented: "
                        f"{', '.join(SUPPORTED_TYPES)}. Requantize the model to one of them with llama-quantize.")
            super()._build_tensors(start_offs, fields)

        def _build_fields(self, offs: int, count: int) -> int:
            """gguf's ``_build_fields`` (same parts, same indexes), but a string array's parts and indexes are a
            ``_StringArray`` and a ``range`` (no list of one part per string and one index per string)."""
            ReaderField = gguf.ReaderField
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                head = [kv_klen, kv_kdata, raw_kv_type]
                field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                if isinstance(field_parts, _StringArray):
                    parts, idxs = field_parts.after(head), field_parts.indexes(len(head))
                else:
                    parts, idxs = head + list(field_parts), [idx + len(head) for idx in field_idxs]
                self._push_field(ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts, idxs,
                                             field_types), skip_sum=True)
                offs += field_size
            return offs

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            """gguf's parts of a metadata value, but an array of strings or numbers as few Python objects: gguf
            makes two numpy views per string and one per number (a 49k-token vocabulary and its merges: about
            150 MB of views, held as long as the reader), here one offset per string (``_StringArray``: a part
            is made when read) and one view for all the numbers. ``ReaderField.contents()`` reads both forms
            alike (``field.data`` of a number array then indexes the one view)."""
            GGUFValueType = gguf.GGUFValueType
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            item = GGUFValueType(int(raw_itype[0]))
            n, offs = int(alen[0]), orig_offs + 12
            if item == GGUFValueType.STRING:
                buf, end = memoryview(self.data), self.data.size
                starts = np.empty(n + 1, np.int64)  # string i: its length's 8 bytes at starts[i], then its bytes
                for i in range(n):
                    if offs + 8 > end:
                        raise ValueError(f"a string array runs past the end of the file at byte {offs}")
                    starts[i] = offs
                    offs += 8 + int.from_bytes(buf[offs:offs + 8], "little")
                    if offs > end:
                        raise ValueError(f"a string array runs past the end of the file at byte {starts[i]}")
                starts[n] = offs
                return offs - orig_offs, _StringArray([raw_itype, alen], self.data, starts), None, [
                    GGUFValueType.ARRAY, item]
            nptype = self.gguf_scalar_to_np.get(item)
            if nptype is None:  # nested arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            if values.size != n:
                raise ValueError(f"an array of {n} values runs past the end of the file at byte {offs}")
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2] if n else [], [GGUFValueType.ARRAY, item]

    with open_regular(path, "a GGUF checkpoint file", CheckpointError) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{path}: the file is {size} bytes long, too short for a GGUF header (magic, "
                                  f"version and counts: 24 bytes); it is truncated or not a GGUF file.")
        magic = handle.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: the file does not start with the GGUF magic bytes (found {magic!r}); "
                                  f"it is not a GGUF file, or its first bytes are damaged.")
        handle.seek(0)
        try:
            reader = Reader(handle)
        except CheckpointError:
            raise
        except Exception as exc:  # the reader raises whatever numpy does on a malformed header
            why = str(exc).split("\n")[0][:300] or type(exc).__name__
            raise CheckpointError(
                f"{path}: the GGUF reader rejects the file ({type(exc).__name__}: {why}); it is truncated or "
                f"corrupt (or of a type this gguf package does not know). Download or convert it again.") from None
    reader.data.filename = os.path.abspath(path)  # named as a map numpy opened by name (runtimes' file pages)
    return reader


def _drop_pages(data: np.ndarray, part: np.ndarray) -> bool:
    """Drop the whole pages of the file map ``data`` that the contiguous view ``part`` lies on from this process's
    page tables (``madvise(MADV_DONTNEED)`` on the map); False where nothing was dropped (no such call, not a view
    of this map, no whole page inside it)."""
    import mmap

    mm = getattr(data, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or \
            not part.flags.c_contiguous:
        return False
    base = data.__array_interface__["data"][0] - int(getattr(data, "offset", 0) or 0)
    start = part.__array_interface__["data"][0] - base
    end = start + part.nbytes
    if start < 0 or end > len(mm):
        return False
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return False
    try:
        mm.madvise(mmap.MADV_DONTNEED, first, last - first)
    except (OSError, ValueError):
        return False
    return True


class _Bytes(bytes):
    """A metadata string as ``ReaderField.contents()`` reads a part (``part.tobytes()``), without a numpy view."""

    __slots__ = ()

    def tobytes(self) -> bytes:
        return bytes(self)


class _StringArray:
    """The parts of a string-array field (``ReaderField.parts``): the field's leading parts (its name, type, item
    type and length), then one part per string, made when read (a ``_Bytes`` copied out of the file map). The
    strings are held as one offset each into the map (8 bytes a string: a 49k-token vocabulary and its merges
    took ~9.5 MiB as one ``bytes`` and one index per string)."""

    __slots__ = ("head", "data", "starts")

    def __init__(self, head: list, data: np.ndarray, starts: np.ndarray):
        self.head, self.data, self.starts = head, data, starts

    def after(self, leading: list) -> _StringArray:
        return _StringArray([*leading, *self.head], self.data, self.starts)

    def indexes(self, leading: int) -> range:
        """The parts' indexes of the strings (``ReaderField.data``) once ``leading`` parts come first."""
        first = leading + len(self.head)
        return range(first, first + len(self.starts) - 1)

    def __len__(self) -> int:
        return len(self.head) + len(self.starts) - 1

    def __getitem__(self, index: int):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if index < len(self.head):
            return self.head[index]
        i = index - len(self.head)
        if not 0 <= i < len(self.starts) - 1:
            raise IndexError(index)
        start, end = int(self.starts[i]) + 8, int(self.starts[i + 1])
        return _Bytes(self.data[start:end])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


def _check_types(path: Path, reader: Any) -> None:
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if bad:
        shown = ", ".join(f"'{n}' ({t})" for n, t in bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise CheckpointError(
            f"{path}: tensor {shown} is stored in a type this reader does not implement (implemented: "
            f"{', '.join(SUPPORTED_TYPES)}); requantize the model with llama.cpp's llama-quantize to one of them "
            f"(e.g. Q4_K_M or Q8_0).")


def _value(found: Any, path: Path, key: str) -> Any:
    try:
        value = found.contents()
    except Exception as exc:
        raise CheckpointError(f"{path}: metadata key '{key}' cannot be read ({exc}); the file is corrupt.") from None
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _config(path: Path, reader: Any, architecture: str, spec: dict, names: list[str]) -> dict[str, Any]:
    """The config.json transformers would build from the metadata (see gguf_architectures.yaml), every key of the
    architecture honoured or refused."""
    fields = reader.fields
    prefix = architecture + "."
    mapped, same, require, ignore = (spec.get(k) or {} for k in ("config", "same", "require", "ignore"))
    config: dict[str, Any] = {}
    problems: list[str] = []
    stated: dict[str, Any] = {}
    for key in fields:
        if key.startswith("GGUF.") or key.startswith(DESCRIPTIVE_PREFIXES) or key.startswith(TOKENIZER_PREFIX):
            continue
        if not key.startswith(prefix):
            problems.append(f"'{key}' is not a key of architecture {architecture} (split files, adapters and other "
                            f"layouts are not implemented)")
            continue
        sub = key[len(prefix):]
        value = _value(fields[key], path, key)
        stated[sub] = value
        if sub in mapped:
            targets = mapped[sub] if isinstance(mapped[sub], list) else [mapped[sub]]
            for target in targets:
                _set(config, target, value)
        elif sub in require:
            if value not in require[sub]:
                allowed = ", ".join(repr(v) for v in require[sub])
                problems.append(f"'{key}' is {value!r}; reading this architecture from GGUF implements only "
                                f"{allowed}")
        elif sub in same or sub in ignore:
            continue
        else:
            problems.append(f"'{key}' (= {_short(value)}) is not a key this reader implements for architecture "
                            f"{architecture}, so what it changes would be lost")
    for sub, other in same.items():
        if sub in stated and other in stated and stated[sub] != stated[other]:
            problems.append(f"'{prefix}{sub}' is {stated[sub]!r} but '{prefix}{other}' is {stated[other]!r}; "
                            f"the recipe reads one size for both")
    if problems:
        raise CheckpointError(
            f"{path}: the GGUF metadata asks for what is not implemented ({len(problems)} key"
            f"{'s' * (len(problems) != 1)}):\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nThe reference would compute something else with these, so the file is refused; use the model's "
              "safetensors checkpoint with its recipe.")
    if spec.get("config_beside"):  # no sizes in the metadata: GgufCheckpoint.open reads the config file beside
        return {}
    config["model_type"] = spec["model_type"]
    for key, value in (spec.get("defaults") or {}).items():
        config.setdefault(key, value)
    config["tie_word_embeddings"] = "output.weight" not in names
    for flag, pattern in (spec.get("flags") or {}).items():  # e.g. rope_freq_factors: rope_freqs.weight is there
        if any(re.fullmatch(pattern, n) for n in names):
            config[flag] = True
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    for ggml, target in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("padding_token_id", "pad_token_id")):
        found = fields.get(f"tokenizer.ggml.{ggml}")
        if found is not None:
            config[target] = _value(found, path, f"tokenizer.ggml.{ggml}")
    return config


def _config_beside(path: Path, name: str, architecture: str) -> dict[str, Any]:
    """The config file ``name`` in the folder of the GGUF file ``path``, for an architecture whose files state no
    sizes (``config_beside`` in gguf_architectures.yaml)."""
    from ..files import MAX_JSON_BYTES, present, read_json

    config_path = path.parent / name
    if not present(config_path):
        raise CheckpointError(
            f"{path}: a GGUF file of architecture '{architecture}' states no model sizes in its metadata, and there "
            f"is no {name} beside it ({config_path}); put the {name} of the model's original checkpoint next to "
            f"the file (for FLUX.2-dev: the transformer/{name} of black-forest-labs/FLUX.2-dev).")
    try:
        data = read_json(config_path, "the model's config", MAX_JSON_BYTES, CheckpointError,
                         fix="download or write it again")
    except OSError as exc:
        raise CheckpointError(f"cannot read {config_path} ({exc.strerror or exc}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object (the model's configuration).")
    return data


def _set(config: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rename(name: str, spec: dict) -> str:
    for pattern, template in spec["_rename"]:
        if pattern.search(name):
            return pattern.sub(template, name, count=1)
    return name


def _record(path: Path, name: str, tensor: Any, spec: dict, config: dict) -> GgufTensor:
    stored = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims fastest first
    shape, ops, order = stored, [], None
    for pattern, rule in spec["_transforms"]:
        if not pattern.fullmatch(name):
            continue
        op = rule["op"]
        if op == "unpermute":
            heads = config.get(rule["heads"])
            rows = stored[0]
            if not isinstance(heads, int) or heads <= 0 or rows % (2 * heads):
                raise CheckpointError(
                    f"{path}: tensor '{tensor.name}' has {rows} rows, which {rule['heads']} = {heads!r} heads of "
                    f"rotary pairs cannot divide; the metadata does not match the tensors.")
            order = np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(rows)
        elif op == "transpose":
            if len(stored) != 2:
                raise CheckpointError(f"{path}: tensor '{tensor.name}' has shape {list(stored)}; a 2-D weight was "
                                      f"expected.")
            shape = stored[::-1]
        elif op != "subtract_one":
            raise CheckpointError(f"{ARCHITECTURES_FILE}: transform '{op}' is not one of unpermute, transpose, "
                                  f"subtract_one")
        ops.append(op)
    if math.prod(stored) != int(tensor.n_elements):
        raise CheckpointError(f"{path}: tensor '{tensor.name}' states {int(tensor.n_elements)} elements but shape "
                              f"{list(stored)}; the file is corrupt.")
    return GgufTensor(name, tensor.name, tensor.tensor_type, shape, stored, tensor.data, tuple(ops), order)
