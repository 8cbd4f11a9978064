"""Lazy, memory-mapped access to safetensors checkpoints (single files, folders, sharded ``*.index.json``).

Every header is validated here before anything else touches the file (length prefix, JSON, dtype names,
shapes, offsets inside the file, no overlaps or holes, byte counts matching shape x dtype), so a corrupt
download fails with a message naming the file and the tensor instead of a crash deep inside a run. The
``safetensors`` package then opens the file as a second, independent validator and reads its metadata. Tensor
bytes are served as read-only ``numpy.memmap`` views: nothing is read until a tensor is used, and nothing is
copied (``safe_open``'s numpy framework copies each tensor and, in safetensors 0.8, cannot return F8_E4M3)."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from ..errors import CheckpointError
from ..files import check_fence, open_regular, parse_json, read_json
from .formats import LEGACY_FP8_MARKER, comfy_legacy_fp8_renames

# dtype name in a safetensors header -> (bits per element, numpy dtype the bytes are viewed as; a name is one of
# ml_dtypes' types, imported when such a tensor is read: ``_view_dtype``)
DTYPES: dict[str, tuple[int, np.dtype | str]] = {
    "BOOL": (8, np.dtype(np.bool_)),
    "U8": (8, np.dtype(np.uint8)),
    "I8": (8, np.dtype(np.int8)),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "U16": (16, np.dtype("<u2")),
    "I16": (16, np.dtype("<i2")),
    "F16": (16, np.dtype("<f2")),
    "BF16": (16, "bfloat16"),
    "U32": (32, np.dtype("<u4")),
    "I32": (32, np.dtype("<i4")),
    "F32": (32, np.dtype("<f4")),
    "U64": (64, np.dtype("<u8")),
    "I64": (64, np.dtype("<i8")),
    "F64": (64, np.dtype("<f8")),
    "C64": (64, np.dtype("<c8")),
    "F4": (4, np.dtype(np.uint8)),  # packed E2M1 pairs; loaded as uint8 with the last dim halved
}


def _view_dtype(name: str) -> np.dtype:
    """The numpy dtype a tensor of safetensors dtype ``name`` is viewed as."""
    found = DTYPES[name][1]
    if isinstance(found, str):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, found))
    return found


MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
# tensors of one file, counted by the header's objects before it is parsed: a 70 MB header of 1,000,000 one-number
# tensors took 2.2 GB and 46 s to read; the largest single files published hold tens of thousands
MAX_TENSORS_PER_FILE = 1 << 18
INDEX_SUFFIX = ".safetensors.index.json"
STANDARD_STEMS = ("diffusion_pytorch_model", "model")  # diffusers and transformers file names
QUANT_METADATA_KEY = "_quantization_metadata"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: shape and dtype as in the header, absolute byte range in its file."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    start: int
    end: int
    stored_name: str = ""  # the name in the file, when a legacy name was mapped onto ``name``

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    bits = DTYPES[dtype][0] * math.prod(shape)
    return bits // 8 if bits % 8 == 0 else -1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate the header of one ``.safetensors`` file; ``(tensors by name, __metadata__)``.

    Raises :class:`CheckpointError` listing every problem found, each naming the tensor.
    """
    path = Path(path)
    try:
        with open_regular(path, "a checkpoint file", CheckpointError) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                _corrupt(
                    path,
                    [f"the file is {size} bytes long, too short for the 8-byte header length (truncated?)"],
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                _corrupt(
                    path,
                    [
                        f"the header length prefix says {header_len} bytes (limit {MAX_HEADER_BYTES}); this "
                        "is not a safetensors file or its first bytes are damaged"
                    ],
                )
            if 8 + header_len > size:
                _corrupt(
                    path,
                    [
                        f"the header should be {header_len} bytes but only {size - 8} follow the length "
                        "prefix (truncated file, or not a safetensors file)"
                    ],
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e.strerror or e}") from e
    objects = raw.count(b"{")  # every tensor's entry is an object, and JSON cannot spell "{" otherwise
    if objects > MAX_TENSORS_PER_FILE + 1:
        _corrupt(path, [f"the header holds {objects} JSON objects, more than the {MAX_TENSORS_PER_FILE} tensors "
                        f"this tool reads from one file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _corrupt(path, [f"the header is not valid UTF-8 JSON ({e})"])
    header = parse_json(text, f"safetensors file {path}: the header", CheckpointError,
                        fix="download or export the file again", kind="UTF-8 JSON")
    if not isinstance(header, dict):
        _corrupt(path, [f"the header is a JSON {type(header).__name__}, not an object of tensors"])

    problems: list[str] = []
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        problems.append("__metadata__ must map strings to strings")
        metadata = {}
    data_start, data_len = 8 + header_len, size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        problem = _entry_problem(name, entry, data_len)
        if problem:
            problems.append(problem)
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = TensorInfo(
            name, tuple(entry["shape"]), entry["dtype"], path, data_start + begin, data_start + end, name
        )
    ordered = sorted(tensors.values(), key=lambda t: (t.start, t.end))
    problems += _layout_problems(ordered, data_start, data_len, check_tail=not problems)
    if problems:
        _corrupt(path, problems)
    return tensors, metadata


def _entry_problem(name: str, entry: object, data_len: int) -> str | None:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return f"tensor '{name}': entry must be an object with dtype, shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        return f"tensor '{name}': unknown dtype {dtype!r} (known: {', '.join(DTYPES)})"
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return f"tensor '{name}': shape {shape!r} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        return f"tensor '{name}': data_offsets {offsets!r} must be two non-negative integers"
    begin, end = offsets
    if end < begin:
        return f"tensor '{name}': data_offsets [{begin}, {end}] end before they begin"
    if end > data_len:
        return (
            f"tensor '{name}': data_offsets [{begin}, {end}] run past the end of the data, which holds "
            f"{data_len} bytes (truncated file?)"
        )
    need = _nbytes(dtype, tuple(shape))
    if need != end - begin:
        return f"tensor '{name}': holds {end - begin} bytes but shape {shape} of {dtype} needs " + (
            f"{need}" if need >= 0 else "a whole number of bytes"
        )
    return None


def _layout_problems(
    ordered: list[TensorInfo], data_start: int, data_len: int, check_tail: bool
) -> list[str]:
    """Overlaps, holes and trailing bytes: safetensors requires the tensors to tile the data exactly."""
    problems, cursor, previous = [], data_start, None
    for info in ordered:
        if info.start < cursor and previous is not None:
            problems.append(
                f"tensors '{previous.name}' and '{info.name}' overlap (bytes {info.start - data_start}-"
                f"{min(cursor, info.end) - data_start} of the data are claimed by both)"
            )
        elif info.start > cursor:
            after = f"after '{previous.name}'" if previous else "at the start of the data"
            problems.append(f"{info.start - cursor} unused bytes {after}, before tensor '{info.name}'")
        if info.end >= cursor:
            cursor, previous = info.end, info
    if check_tail and cursor < data_start + data_len and not problems:
        problems.append(f"{data_start + data_len - cursor} bytes after the last tensor belong to no tensor")
    return problems


def _corrupt(path: Path, problems: list[str]) -> NoReturn:
    listed = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
    raise CheckpointError(
        f"safetensors file {path} is corrupt: {listed}. Download or export the file again (compare its size "
        "with the source)."
    )


def _library_check(path: Path) -> dict[str, str]:
    """Open with the safetensors package too: a second validator, and its reading of ``__metadata__``."""
    from safetensors import SafetensorError, safe_open  # here: a GGUF checkpoint never loads the library

    check_fence(path)  # the library opens the path itself: the same fence as files.open_regular's
    try:
        with safe_open(path, framework="numpy") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"safetensors file {path} is rejected by the safetensors library: {e}. Download or "
            "export the file again."
        ) from e


# --- checkpoints: one or many files -----------------------------------------------------------------------
class TensorMapping:
    """The mapping every checkpoint format gives the builder: name -> ``TensorInfo`` (its ``tensors``), sorted
    names; ``_what`` names the container in errors."""

    _what = "checkpoint"

    @property
    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.info(name)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor '{name}' is not in {self._what} {self.root}") from None


@dataclass
class Checkpoint(TensorMapping):
    """Safetensors files seen as one name -> tensor mapping. Tensors are mapped, never read, until loaded."""

    root: Path
    tensors: dict[str, TensorInfo]
    file_metadata: dict[Path, dict[str, str]]
    index: Path | None = None  # the ``*.safetensors.index.json`` of a sharded checkpoint
    legacy_fp8_marker: str | None = None  # ComfyUI ``scaled_fp8`` marker that was folded into canonical names
    _maps: dict[Path, np.memmap] = field(default_factory=dict, repr=False)

    # construction ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open a ``.safetensors`` file, a ``*.safetensors.index.json``, or a folder holding either."""
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(
                f"checkpoint path {path} does not exist; check --weights or the recipe's weights source"
            )
        if path.is_dir():
            return cls._from_files(path, *_weight_files(path))
        if path.name.endswith(INDEX_SUFFIX):
            return cls._from_files(path.parent, [], path)
        if path.suffix == ".safetensors":
            return cls._from_files(path.parent, [path], None)
        raise CheckpointError(f"{path} is neither a .safetensors file, a *{INDEX_SUFFIX} index nor a folder")

    @classmethod
    def _from_files(cls, root: Path, files: list[Path], index: Path | None) -> Checkpoint:
        weight_map = _read_index(index) if index else {}
        if index:
            files = sorted({index.parent / f for f in weight_map.values()})
            missing = [f for f in files if not f.is_file()]
            if missing:
                names = ", ".join(f.name for f in missing)
                raise CheckpointError(
                    f"index {index} names shard(s) that are not in {index.parent}: {names}. "
                    "Download the missing shards (or the whole folder) again."
                )
        tensors: dict[str, TensorInfo] = {}
        metadata: dict[Path, dict[str, str]] = {}
        for file in files:
            found, _ = read_header(file)
            metadata[file] = _library_check(file)
            for name, info in found.items():
                if name in tensors:
                    raise CheckpointError(
                        f"tensor '{name}' is in both {tensors[name].file} and {file}; these files are not "
                        "shards of one checkpoint. Point --weights at one file, or at a folder with an index."
                    )
                tensors[name] = info
        misplaced = [
            f"'{n}' (index: {f}, found: {tensors[n].file.name if n in tensors else 'nowhere'})"
            for n, f in weight_map.items()
            if n not in tensors or tensors[n].file.name != Path(f).name
        ]
        if misplaced:
            raise CheckpointError(
                f"index {index} does not match its shards: {', '.join(misplaced[:10])}"
                + (f" and {len(misplaced) - 10} more" if len(misplaced) > 10 else "")
                + ". Download the index and shards again from the same revision."
            )
        renames, marker = comfy_legacy_fp8_renames(set(tensors))
        if marker:
            tensors = _apply_renames(tensors, renames, marker)
        return cls(root=root, tensors=tensors, file_metadata=metadata, index=index, legacy_fp8_marker=marker)

    @property
    def files(self) -> list[Path]:
        return sorted(self.file_metadata)

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of all files merged (shards normally carry the same)."""
        merged: dict[str, str] = {}
        for file in self.files:
            merged.update(self.file_metadata[file])
        return merged

    @property
    def quantization_metadata(self) -> dict | None:
        """ComfyUI's ``_quantization_metadata`` (``{"layers": {module: {"format": ...}}}``) over all files.

        A legacy ``scaled_fp8`` checkpoint yields ``float8_e4m3fn`` layers, as ComfyUI derives them.
        """
        layers: dict[str, dict] = {}
        found = None
        for file in self.files:
            raw = self.file_metadata[file].get(QUANT_METADATA_KEY)
            if raw is None:
                continue
            parsed = parse_json(raw, f"{file}: {QUANT_METADATA_KEY} in the header", CheckpointError,
                                fix="export the checkpoint again")
            if not isinstance(parsed, dict) or not isinstance(parsed.get("layers", {}), dict):
                raise CheckpointError(
                    f"{QUANT_METADATA_KEY} in {file} must be an object with a 'layers' object"
                )
            found = {**(found or {}), **{k: v for k, v in parsed.items() if k != "layers"}}
            layers.update(parsed.get("layers", {}))
        if found is None and self.legacy_fp8_marker:
            prefix = self.legacy_fp8_marker[: -len(LEGACY_FP8_MARKER)]
            layers = {
                n[: -len(".weight_scale")]: {"format": "float8_e4m3fn"}
                for n in self.tensors
                if n.startswith(prefix) and n.endswith(".weight_scale")
            }
            found = {}
        return None if found is None else {**found, "layers": layers}

    # reading -----------------------------------------------------------------------------------------------
    def load(self, name: str) -> np.ndarray:
        """The tensor as a read-only array mapped from disk (zero-copy); F4 comes as packed uint8 pairs."""
        info = self.info(name)
        raw = self._map(info.file)[info.start : info.end]
        shape = info.shape
        if info.dtype == "F4":
            shape = (*shape[:-1], shape[-1] // 2) if shape else shape
        return np.asarray(raw).view(_view_dtype(info.dtype)).reshape(shape)

    def _map(self, file: Path) -> np.memmap:
        if file not in self._maps:
            # opened as every checkpoint file is (files.open_regular: a regular file, inside its fence), then mapped
            with open_regular(file, "a checkpoint file", CheckpointError) as handle:
                if os.fstat(handle.fileno()).st_size == 0:
                    raise CheckpointError(f"checkpoint file {file} is empty")
                mapped = np.memmap(handle, dtype=np.uint8, mode="r")
            # numpy names a map by its file object's name, here a descriptor number: the path lets the runtime
            # drop and prefetch the map's pages (runtimes/file_pages.py), as for a map numpy opened by name
            mapped.filename = os.path.abspath(file)
            self._maps[file] = mapped
        return self._maps[file]

    def close(self) -> None:
        """Drop the memory maps (arrays already handed out keep theirs alive)."""
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apply_renames(
    tensors: dict[str, TensorInfo], renames: dict[str, str], marker: str
) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name == marker:
            continue
        new = renames.get(name, name)
        if new in out or (new != name and new in tensors):
            raise CheckpointError(
                f"legacy FP8 tensor '{name}' maps onto '{new}', which the checkpoint also holds; "
                "the file mixes legacy and current names"
            )
        out[new] = TensorInfo(new, info.shape, info.dtype, info.file, info.start, info.end, name)
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = read_json(index, "a checkpoint index", MAX_HEADER_BYTES, CheckpointError,
                         where=f"cannot read checkpoint index {index}", fix="download the checkpoint's index again")
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint index {index}: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"checkpoint index {index} has no 'weight_map' object of tensor name -> file name"
        )
    for file in set(weight_map.values()):
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"checkpoint index {index} names shard '{file}' outside its folder")
    return weight_map


def _weight_files(folder: Path) -> tuple[list[Path], Path | None]:
    """The files of a folder that form the checkpoint: standard index or file, a lone index, or all files."""
    for stem in STANDARD_STEMS:
        if (folder / f"{stem}{INDEX_SUFFIX}").is_file():
            return [], folder / f"{stem}{INDEX_SUFFIX}"
    for stem in STANDARD_STEMS:
        if (folder / f"{stem}.safetensors").is_file():
            return [folder / f"{stem}.safetensors"], None
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return [], indexes[0]
    if len(indexes) > 1:
        raise CheckpointError(
            f"folder {folder} holds several checkpoint indexes ({', '.join(i.name for i in indexes)});"
            " point --weights at the one to use"
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"folder {folder} holds no .safetensors files; point --weights at the model's folder "
            "(for diffusers pipelines, the component's subfolder such as transformer/)"
        )
    return files, None
