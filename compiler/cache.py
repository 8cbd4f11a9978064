"""Plan cache on disk: a second compile of the same graph loads its program instead of searching.

Entries live in ``$LUMINAL_RECIPES_CACHE`` or else ``$XDG_CACHE_HOME/luminal-recipes`` (default
``~/.cache/luminal-recipes``), one JSON file per key. The key covers everything that changes the result: the
graph's structural hash and its input/weight names, the runtime, the device, the dims, the memory budget, the
search options and the versions of egglog, numpy and this package. Files are written to a temporary name and
renamed, so an interrupted compile never leaves half an entry; an entry that cannot be read is ignored (with a
warning) and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

from luminal_recipes.graph.core import Graph
from luminal_recipes.graph.serialize import structural_hash
from luminal_recipes.runtimes.program import Program

FORMAT = "luminal-recipes/plan"
VERSION = 1


def cache_dir() -> Path:
    explicit = os.environ.get("LUMINAL_RECIPES_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "luminal-recipes"


def cache_dir_source() -> str:
    """Which setting chose ``cache_dir()``, for ``luminal-recipe cache info``."""
    if os.environ.get("LUMINAL_RECIPES_CACHE"):
        return "set by $LUMINAL_RECIPES_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return "under $XDG_CACHE_HOME; set $LUMINAL_RECIPES_CACHE to use another folder"
    return "the default; set $LUMINAL_RECIPES_CACHE to use another folder"


# ---- housekeeping (``luminal-recipe cache info|clear``) ------------------------------------------------------
_ENTRY = re.compile(r"^[0-9a-f]{64}\.json$")  # <key>.json, the key a sha256 (see ``plan_key``)
_LEFTOVER = re.compile(r"^\.[0-9a-f]{64}\..+\.tmp$")  # ``store``'s temporary file, left by a killed process
LEFTOVER_AGE_S = 3600  # younger temporary files may belong to a compile in progress


def entries(directory: Path | None = None) -> list[Path]:
    """The files of ``directory`` (default: the cache folder) that this cache wrote: entries, and temporary files
    of interrupted writes older than an hour. Links and anything else are never counted or removed."""
    directory = cache_dir() if directory is None else directory
    if not directory.is_dir():
        return []
    found = []
    now = time.time()
    for path in directory.iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        if _ENTRY.match(path.name) or _LEFTOVER.match(path.name) and now - path.stat().st_mtime > LEFTOVER_AGE_S:
            found.append(path)
    return sorted(found)


def clear(directory: Path | None = None) -> tuple[int, int]:
    """Remove the cache's own files (``entries``); returns (files removed, bytes freed)."""
    removed = freed = 0
    for path in entries(directory):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:  # another process removed it first
            continue
        removed += 1
        freed += size
    return removed, freed


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def plan_key(graph: Graph, runtime_name: str, device: str, dims: dict, extra: dict) -> str:
    names = [f"{n.attr('kind')}:{n.name}" for n in graph.inputs()]
    parts = {
        "graph": structural_hash(graph),
        "names": hashlib.sha256("\n".join(names + sorted(graph.outputs)).encode()).hexdigest(),
        "runtime": runtime_name,
        "device": device,
        "dims": sorted(dims.items()),
        "versions": [_version("egglog"), np.__version__, _version("luminal-recipes")],
        "extra": extra,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# ---- program <-> JSON (the graph serialiser's format) ------------------------------------------------------
def program_to_json(program: Program) -> dict:
    return program.to_json()


def program_from_json(data: dict) -> Program:
    return Program.from_json(data)


# ---- the store ---------------------------------------------------------------------------------------------
def load(key: str) -> tuple[Program, dict] | None:
    path = cache_dir() / f"{key}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
        return program_from_json(data["program"]), data.get("report", {})
    except Exception as exc:  # any unreadable entry is rebuilt, never trusted
        warnings.warn(f"plan cache entry {path} is unreadable ({type(exc).__name__}: {exc}); ignoring it and "
                      f"compiling again", stacklevel=2)
        return None


def store(key: str, program: Program, report: dict) -> Path:
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    text = json.dumps({"format": FORMAT, "version": VERSION, "program": program_to_json(program),
                       "report": report}, default=str)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # including KeyboardInterrupt: no half-written entry stays behind
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
