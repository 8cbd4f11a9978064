"""Write what a pipeline run produced, by each output's declared type, under names that never overwrite.

Types (a pipeline recipe's ``outputs: {name: {value, type}}``): ``image`` is a decoded picture ``(1, 3, H, W)``
in [-1, 1], post-processed as diffusers does and written as PNG; ``array`` is written as ``.npy``; ``text`` as
UTF-8 ``.txt`` (the CLI also prints it). Undeclared, a string is text and anything else an array.

Default names, as ComfyUI numbers its images: ``outputs/<recipe>-<seed>-<slug>_00001_.png``, the counter one
more than the highest already in the folder for that name (the seed part only when the pipeline has a ``seed``
parameter, the slug only when it takes a prompt, ``-<output>`` added when it writes several outputs). A file is
created, never replaced, unless ``--overwrite`` (an explicit ``--output``); two runs racing for one name get
two numbers.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__, tempfiles
from ..errors import PipelineError
from ..files import name_problem, not_regular
from ..image_io import save_image, slugify
from .atomic_file import OutputExistsError, atomic_write

DEFAULT_OUTPUT_DIR = Path("outputs")
EXTENSIONS = {"image": ".png", "array": ".npy", "text": ".txt"}
COUNTER_DIGITS = 5


@dataclass(frozen=True)
class Output:
    """One declared output of a pipeline: its name, type (None: from the value) and where it was declared."""

    name: str
    type: str | None
    where: str  # "recipe.yaml:84:10"

    def resolved_type(self, value: Any) -> str:
        return self.type or ("text" if isinstance(value, str) else "array")


def run_text(prompt: str | None, recipe: str, recipe_hash: str, settings: Mapping[str, str]) -> dict[str, str]:
    """What an output file records about the run that made it (PNG text chunks): the prompt, the settings the
    task plug-ins describe (seed, steps, size...), the recipe and its hash, and the version."""
    text = {"prompt": prompt} if prompt is not None else {}
    text.update(settings)
    text.update({"recipe": recipe, "recipe_hash": recipe_hash, "version": __version__,
                 "Software": f"luminal-recipes {__version__}"})
    return text


def output_stem(recipe: str, seed: int | None, prompt: str | None, output: str | None = None) -> str:
    """``<recipe>[-<seed>][-<slug>][-<output>]``, file-name safe."""
    parts = [slugify(recipe) or "recipe"]
    if seed is not None:
        parts.append(str(seed))
    if prompt is not None:
        parts.append(slugify(prompt) or "prompt")
    if output is not None:
        parts.append(slugify(output) or "output")
    return "-".join(parts)


def numbered(folder: Path, stem: str, extension: str, counter: int) -> Path:
    return folder / f"{stem}_{counter:0{COUNTER_DIGITS}d}_{extension}"


def next_counter(folder: Path, stems: list[str]) -> int:
    """One more than the highest counter any file in ``folder`` has for one of ``stems`` (1 if none)."""
    if not folder.is_dir():
        return 1
    pattern = re.compile(rf"^(?:{'|'.join(re.escape(s) for s in stems)})_(\d{{{COUNTER_DIGITS},}})_\.\w+$")
    found = [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]
    return max(found, default=0) + 1


def check_explicit_output(path: Path, kind: str, overwrite: bool) -> None:
    """An explicit ``--output``: the right extension; a name where a file can be created (not a folder, a FIFO,
    a device, a link to nothing) in a folder this process can create files in (tried, not guessed from
    permissions: ``/proc/x.png`` or a read-only mount is refused); and not an existing file unless
    ``overwrite`` - checked before any work."""
    want = EXTENSIONS[kind]
    if path.suffix.lower() != want:
        raise PipelineError(f"--output {path}: this pipeline's output is of type {kind}; the file name must end "
                            f"with {want}")
    _check_name(path, f"--output {_shown(path)}", "choose another --output")
    if path.is_dir():
        raise PipelineError(f"--output {path}: is a folder; give a file name ending in {want}")
    if os.path.islink(path) and not path.exists():
        raise PipelineError(f"--output {path}: is a symbolic link to {os.readlink(path)}, which does not exist; "
                            f"remove the link or choose another --output")
    kind_there = not_regular(path)
    if kind_there is not None:
        raise PipelineError(f"--output {path}: is {kind_there}, not a file; choose another --output")
    if path.exists() and not overwrite:
        raise PipelineError(f"--output {path}: the file exists; pass --overwrite to replace it, or omit --output "
                            f"to get a new numbered file in {DEFAULT_OUTPUT_DIR}/")
    _check_writable(path.parent, f"--output {path}", "choose another --output")


def check_output_folder(folder: Path = DEFAULT_OUTPUT_DIR) -> None:
    """The default folder can be created or written (checked before any work, as ``check_explicit_output``)."""
    _check_writable(folder, f"{folder}/", f"pass --output FILE or run from a folder where {folder}/ can be written")


def _check_name(path: Path, what: str, fix: str) -> None:
    problem = name_problem(path)
    if problem is not None:
        raise PipelineError(f"{what}: {problem}; {fix}")


def _shown(path: Path, limit: int = 200) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit - 40]}...{text[-20:]} ({len(text)} characters)"


def _check_writable(folder: Path, what: str, fix: str) -> None:
    """``folder``, or the nearest of its parents that exists when it does not yet, is a folder in which this
    process can create a file: tried with an empty temporary file (``tempfiles.create_temp``, removed at once)."""
    existing = Path(folder)
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what_is = not_regular(existing) or "a file"
        raise PipelineError(f"{what}: {existing} is {what_is if existing.exists() else 'a broken link'}, not a "
                            f"writable folder; {fix}")
    try:  # through the one temporary-file pattern, so a probe a killed process left is swept like any other
        fd, probe = tempfiles.create_temp(existing / "probe", 0o600)
        os.close(fd)
    except OSError as exc:
        raise PipelineError(f"{what}: {existing} is not a writable folder ({exc.strerror or exc}); {fix}") \
            from None
    with contextlib.suppress(OSError):
        os.unlink(probe)


def convert(output: Output, value: Any) -> tuple[str, Any]:
    """``(type, value)`` checked against the output's type, or a PipelineError naming the output."""
    kind = output.resolved_type(value)
    where = f"{output.where}: output '{output.name}'"
    if value is None:
        raise PipelineError(f"{where} has no value (nothing was assigned to it in this run)")
    if kind == "text":
        if not isinstance(value, str):
            raise PipelineError(f"{where} is declared text but the run produced {type(value).__name__}; "
                                f"declare `type: array` or name a text value")
        return kind, value
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USV":
        raise PipelineError(f"{where} is of type {kind} but the run produced {type(value).__name__} "
                            f"({array.dtype}); declare `type: text` for text")
    if kind == "image":
        shape = array.shape
        if not (array.ndim == 4 and shape[:2] == (1, 3) or array.ndim == 3 and shape[0] == 3):
            raise PipelineError(f"{where} is declared an image but has shape {shape}; an image is a decoded "
                                f"picture (1, 3, H, W) or (3, H, W) in [-1, 1]. Declare `type: array` to write "
                                f"it as .npy")
    return kind, array


def write(path: Path, kind: str, value: Any, text: Mapping[str, str], overwrite: bool) -> Path:
    """Write one output; ``OutputExistsError`` if ``path`` exists and not ``overwrite``."""
    if kind == "image":
        return save_image(path, value, text, overwrite=overwrite)
    if kind == "array":
        def dump(handle) -> None:
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(value), allow_pickle=False)
            handle.write(buffer.getbuffer())

        return atomic_write(path, dump, overwrite=overwrite, what="array")
    return atomic_write(path, lambda handle: handle.write(value.encode("utf-8")), overwrite=overwrite,
                        what="text")


def write_numbered(folder: Path, stems: Mapping[str, str], values: Mapping[str, tuple[str, Any]],
                   text: Mapping[str, str]) -> dict[str, Path]:
    """Write every output under its stem with the next free counter (shared by the outputs of one prompt,
    bumped for a file another process took meanwhile)."""
    counter = next_counter(folder, list(stems.values()))
    written = {}
    for name, (kind, value) in values.items():
        n = counter
        while True:
            try:
                written[name] = write(numbered(folder, stems[name], EXTENSIONS[kind], n), kind, value, text,
                                      overwrite=False)
                break
            except OutputExistsError:
                n += 1
    return written
