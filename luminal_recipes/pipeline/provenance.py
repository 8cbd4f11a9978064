"""What an output records about the run that made it, besides what the task plug-ins describe (seed, steps,
size...): the weights (their source, a hub revision, and a short hash of the checkpoint's tensor index), the
runtime and its device, the compute dtype, the LoRAs with their scales, the reference images' hashes, the package
version and the full command; and A1111's ``parameters`` text, which image browsers (A1111's PNG Info, Civitai,
Comfy's loaders, sd-parsers...) read.

The checkpoint hash is the first 10 hex digits of a SHA-256 over every ``*.safetensors`` file's path (relative to
the checkpoint folder) and header (its 8-byte length and the JSON tensor index: names, dtypes, shapes, offsets),
files in sorted order. It is read in microseconds whatever the checkpoint's size, and tells checkpoints of other
layouts or precisions apart; two fine-tunes of one architecture written the same way share it (it hashes the
index, not the values). A reference image's hash is the first 10 hex digits of the SHA-256 of its file (or, given
as pixels in Python, of its ``(H, W, 3)`` uint8 bytes; uploaded to `serve`, of the uploaded file's bytes, so the
same file gives the same hash)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__

HASH_DIGITS = 10  # as A1111's "Model hash"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def checkpoint_hash(folder: str | Path) -> str | None:
    """The short hash of the checkpoint's tensor index (see the module docstring); None when the folder holds
    no safetensors file."""
    folder = Path(folder)
    files = sorted(folder.rglob("*.safetensors")) if folder.is_dir() else \
        ([folder] if folder.suffix == ".safetensors" else [])
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder) if folder.is_dir() else path.name).encode())
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) == 8:
                (size,) = struct.unpack("<Q", head)
                digest.update(head + handle.read(min(size, MAX_HEADER_BYTES)))
    return digest.hexdigest()[:HASH_DIGITS]


def file_hash(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:HASH_DIGITS]


def image_hash(image: Any) -> str:
    """A reference image's short hash: of its file, or of its pixels when given as an array."""
    if isinstance(image, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()[:HASH_DIGITS]
    if isinstance(image, bytes):  # a file's bytes (an upload to `serve`): the hash of that file
        return hashlib.sha256(image).hexdigest()[:HASH_DIGITS]
    return file_hash(image)


def weights_source(given: str | None, folder: Path) -> str:
    """The weights as a user would give them again: ``hf://org/repo@<commit>`` for a hub checkpoint (the commit
    of the downloaded snapshot when no revision was named), else the folder's absolute path."""
    if given is not None and str(given).startswith("hf://"):
        text = str(given)
        parts = folder.resolve().parts
        if "@" not in text and "snapshots" in parts:
            commit = parts[parts.index("snapshots") + 1] if parts.index("snapshots") + 1 < len(parts) else None
            if commit:
                repo = text[len("hf://"):].split("/")
                text = "hf://" + "/".join(repo[:2]) + f"@{commit}" + ("/" + "/".join(repo[2:]) if repo[2:] else "")
        return text
    if given is not None and str(given).startswith("python://"):
        return str(given)
    return str(folder.resolve())


def model_name(source: str) -> str:
    """A short name of the weights for A1111's ``Model`` field: the repository or folder name."""
    text = source.split("@", 1)[0].rstrip("/")
    return text.rsplit("/", 1)[-1] or text


def a1111_quote(value: Any) -> str:
    """A value as A1111 writes it in an infotext (``infotext_utils.quote``): JSON-quoted when it holds a comma,
    a colon or a newline."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def a1111_parameters(prompt: str | None, fields: Mapping[str, Any]) -> str:
    """A1111's ``parameters`` text: the prompt, a newline, then ``Key: value`` pairs joined by ", " (None values
    left out), as ``processing.create_infotext`` writes it."""
    line = ", ".join(f"{key}: {a1111_quote(value)}" for key, value in fields.items() if value is not None)
    return f"{prompt or ''}\n{line}".strip()


def provenance(*, prompt: str | None, settings: Mapping[str, str], weights: str, weights_hash: str | None,
               runtime: str, device: str, compute_dtype: str | None, loras: Sequence[str],
               images: Sequence[Any], command: str | None, model: str) -> dict[str, str]:
    """The text chunks this module adds (see the module docstring), beside ``settings`` (the plug-ins')."""
    text = {"weights": weights}
    if weights_hash is not None:
        text["weights_hash"] = weights_hash
    text["runtime"] = runtime
    text["device"] = device
    text["compute_dtype"] = compute_dtype or "recipe default"
    if loras:
        text["loras"] = ", ".join(loras)
    if images:
        text["image_hashes"] = ", ".join(image_hash(image) for image in images)
    if command:
        text["command"] = command
    size = settings.get("size")
    fields = {"Steps": settings.get("steps"), "Sampler": settings.get("sampler"),
              "CFG scale": settings.get("guidance"), "Seed": settings.get("seed"), "Size": size,
              "Model hash": weights_hash, "Model": model,
              "Version": f"luminal-recipes {__version__}"}
    text["parameters"] = a1111_parameters(prompt, fields)
    return text
