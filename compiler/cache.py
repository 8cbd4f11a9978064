"""Plan cache on disk: a second compile of the same graph loads its program instead of searching.

Entries live in ``$LUMINAL_RECIPES_CACHE`` or else ``$XDG_CACHE_HOME/luminal-recipes`` (default
``~/.cache/luminal-recipes``), one JSON file per key. The key covers everything that changes the result: the
graph's structural hash and its input/weight names, the runtime, the device, the dims, the memory budget, the
search options and the versions of egglog, numpy and this package. Files are written to a temporary name and
renamed, so an interrupted compile never leaves half an entry. Each entry carries a SHA-256 checksum of its
content, and its program is checked against the kernel vocabulary when read: an entry that was edited, damaged
or cannot be read is ignored with a warning naming the file, and rebuilt. A cache folder that cannot be read
or written means compiling without a cache (with a warning), never a failed run.
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
from luminal_recipes.runtimes.program import KERNELS, Program

FORMAT = "luminal-recipes/plan"
VERSION = 2  # 2: entries carry a checksum
_warned: set[str] = set()  # cache folders already warned about in this process


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
    """The program an entry holds; ValueError if it is not a well-formed program of known kernels."""
    for i, item in enumerate(data["nodes"]):
        if item["op"] not in KERNELS:
            raise ValueError(f"node {i} has the unknown kernel {str(item['op'])[:60]!r}")
        if any(not isinstance(src, int) or not 0 <= src < i for src, _ in item["inputs"]):
            raise ValueError(f"node {i} reads a node that does not come before it")
    if any(not isinstance(src, int) or not 0 <= src < len(data["nodes"]) for src, _ in data["outputs"].values()):
        raise ValueError("an output names a node the program does not have")
    return Program.from_json(data)


def _checksum(entry: dict) -> str:
    """SHA-256 of an entry's content (everything but the checksum), in canonical JSON."""
    body = {k: v for k, v in entry.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _warn_once(directory: Path, message: str) -> None:
    if str(directory) not in _warned:
        _warned.add(str(directory))
        warnings.warn(message, stacklevel=3)


# ---- the store ---------------------------------------------------------------------------------------------
def load(key: str) -> tuple[Program, dict] | None:
    """The cached program and search report for ``key``, or None (a miss, or an entry not to be trusted)."""
    directory = cache_dir()
    path = directory / f"{key}.json"
    try:
        if not path.is_file():
            return None
        raw = path.read_bytes()
    except OSError as exc:  # e.g. a folder without read permission
        _warn_once(directory, f"cannot read the plan cache entry {path} ({exc.strerror or exc}); compiling "
                              f"without the cache. Set LUMINAL_RECIPES_CACHE to a usable folder.")
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            got = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"not a version {VERSION} plan entry (version {got!r})")
        if data.get("checksum") != _checksum(data):
            raise ValueError("its content does not match its checksum (edited or damaged)")
        return program_from_json(data["program"]), data.get("report", {})
    except Exception as exc:  # any entry that cannot be trusted is rebuilt, never used
        warnings.warn(f"plan cache entry {path} is unreadable or untrusted ({type(exc).__name__}: {exc}); "
                      f"ignoring it and compiling again (the new plan replaces it)", stacklevel=2)
        return None


def store(key: str, program: Program, report: dict) -> Path | None:
    """Write the entry for ``key``; None (with a warning, once per folder) when the cache is not writable."""
    directory = cache_dir()
    path = directory / f"{key}.json"
    entry = {"format": FORMAT, "version": VERSION, "program": program_to_json(program), "report": report}
    entry = json.loads(json.dumps(entry, default=str))  # the checksum covers exactly what a reader will see
    entry["checksum"] = _checksum(entry)
    text = json.dumps(entry)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        _warn_once(directory, f"the plan cache folder {directory} is not usable ({exc.strerror or exc}); "
                              f"compiling without a cache. Set LUMINAL_RECIPES_CACHE to a writable folder.")
        return None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: no entry, no half-written file, and the run goes on
        Path(tmp).unlink(missing_ok=True)
        _warn_once(directory, f"cannot write the plan cache entry {path} ({exc.strerror or exc}); compiling "
                              f"without a cache")
        return None
    except BaseException:  # including KeyboardInterrupt: no half-written entry stays behind
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
