"""Plan cache on disk: a second compile of the same graph loads its program instead of searching.

Entries live in ``$LUMINAL_RECIPES_CACHE`` or else ``$XDG_CACHE_HOME/luminal-recipes`` (default
``~/.cache/luminal-recipes``), one JSON file per key. The key covers everything that changes the result: the
graph's structural hash and its input/weight names, the runtime, the device, the dims, the memory budget, the
search options and the versions of egglog, numpy and this package. Files are written to a temporary name and
renamed (``luminal_recipes.tempfiles``), so an interrupted compile never leaves half an entry, and temporary
files a killed process left are swept (by name pattern and age) the next time the folder is used.

What the cache trusts: the user's own key, nothing in the cache folder. Each entry carries an HMAC-SHA256 of its
content under a secret key of the user's (``key_path()``: ``$LUMINAL_RECIPES_CACHE_KEY``, else
``$XDG_CONFIG_HOME/luminal-recipes/cache.key``, else ``~/.config/luminal-recipes/cache.key``; made with mode 0600
on first use), kept outside the cache folder: whoever can write the folder but not read the key cannot make an
entry this user's runs accept. Entries written under another key (another user's, on a shared folder) are
misses, rebuilt and replaced. Every entry read is also checked before use against the graph it claims to compile
(``plan_check``: kernels and attributes of the registry, operands of that graph, views in bounds for every size
of the bucket, sizes and nesting bounded); the file is stat'ed first and never read past ``MAX_ENTRY_BYTES``
(plus the graph's constants). An entry that fails any of this is a miss: ignored with a one-line warning naming
the file and the reason, rebuilt, and replaced. A cache folder that cannot be read or written means compiling
without a cache (with a warning), never a failed run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

from luminal_recipes import tempfiles
from luminal_recipes.graph.core import Graph
from luminal_recipes.graph.serialize import format_graph, structural_hash
from luminal_recipes.runtimes.program import KERNELS, Program

from .plan_check import check_program

FORMAT = "luminal-recipes/plan"
VERSION = 3  # 2: entries carry a checksum; 3: the checksum is an HMAC under the user's key
MAX_ENTRY_BYTES = 32 << 20  # an entry's program and report, besides the graph's array constants (base64)
_warned: set[str] = set()  # cache folders (and key files) already warned about in this process


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
LEFTOVER_AGE_S = tempfiles.STALE_AFTER_S  # younger temporary files may belong to a compile in progress


def entries(directory: Path | None = None) -> list[Path]:
    """The files of ``directory`` (default: the cache folder) that this cache wrote: entries, and temporary files
    of interrupted writes that are stale (``tempfiles.is_stale``: older than an hour, their writer gone). Links
    and anything else are never counted or removed."""
    directory = cache_dir() if directory is None else directory
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        if _ENTRY.match(path.name):
            found.append(path)
    return sorted(found + tempfiles.stale(directory))


def clear(directory: Path | None = None) -> tuple[int, int]:
    """Remove the cache's own files (``entries``, and the torch backend's in ``torch/``) and the stale temporary
    files of the compiled CUDA modules kept beside it (``cuda/``, ``cuda/emu/``); returns (files removed, bytes
    freed)."""
    directory = cache_dir() if directory is None else directory
    removed = freed = 0
    # ``torch/``: the torch backend's translations (``luminal_recipes/torch_backend/translation_cache.py``)
    for path in entries(directory) + entries(directory / "torch"):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:  # another process removed it first
            continue
        removed += 1
        freed += size
    for sub in (directory / "cuda", directory / "cuda" / "emu"):
        if sub.is_dir() and not sub.is_symlink():
            n, size = tempfiles.sweep(sub)
            removed, freed = removed + n, freed + size
    return removed, freed


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def wiring_hash(graph: Graph) -> str:
    """The graph as the plan will read it: every node in order with its inputs BY NODE (so one weight used twice
    and two equal weights differ), its named inputs, weights and outputs in place (so f(a, b) and f(b, a)
    differ). The structural hash ignores both on purpose (it finds repeated blocks); a cached program is checked
    against its graph's kinds, shapes and dtypes only, so the key must tell such graphs apart."""
    return hashlib.sha256(format_graph(graph).encode()).hexdigest()


def plan_key(graph: Graph, runtime_name: str, device: str, dims: dict, extra: dict) -> str:
    names = [f"{n.attr('kind')}:{n.name}" for n in graph.inputs()]
    parts = {
        "graph": structural_hash(graph),
        "wiring": wiring_hash(graph),
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
    """The program an entry holds; ValueError if it is not a well-formed program of known kernels (entries read
    from the cache are checked against their graph instead: ``plan_check.check_program``)."""
    for i, item in enumerate(data["nodes"]):
        if item["op"] not in KERNELS:
            raise ValueError(f"node {i} has the unknown kernel {str(item['op'])[:60]!r}")
        if any(not isinstance(src, int) or not 0 <= src < i for src, _ in item["inputs"]):
            raise ValueError(f"node {i} reads a node that does not come before it")
    if any(not isinstance(src, int) or not 0 <= src < len(data["nodes"]) for src, _ in data["outputs"].values()):
        raise ValueError("an output names a node the program does not have")
    return Program.from_json(data)


# ---- the key: an HMAC under the user's secret, kept outside the cache folder --------------------------------
_KEY_BYTES = 32
_keys: dict[str, bytes] = {}


def key_path() -> Path:
    """Where the user's cache key is: ``$LUMINAL_RECIPES_CACHE_KEY``, else under ``$XDG_CONFIG_HOME`` (default
    ``~/.config``) ``/luminal-recipes/cache.key``."""
    explicit = os.environ.get("LUMINAL_RECIPES_CACHE_KEY")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "luminal-recipes" / "cache.key"


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        text = os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"it does not hold a key (at least {2 * 16} hex digits)")
    return key


def secret_key() -> bytes:
    """The user's cache key, made (32 random bytes, hex, mode 0600) the first time; ``OSError``/``ValueError``
    when it can be neither read nor made."""
    path = key_path()
    if str(path) in _keys:
        return _keys[str(path)]
    try:
        key = _read_key(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, temp = tempfiles.create_temp(path, 0o600)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(_KEY_BYTES) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temp, path)  # never replaces a key another process made meanwhile
            except FileExistsError:
                pass  # theirs is the key
            except OSError:  # a file system without hard links
                if not path.exists():
                    os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        key = _read_key(path)
    _keys[str(path)] = key
    return key


def _canonical(entry: dict) -> bytes:
    body = {k: v for k, v in entry.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, default=str).encode()


def _checksum(entry: dict, key: bytes | None = None) -> str:
    """HMAC-SHA256 of an entry's content (everything but the checksum, canonical JSON) under the user's key."""
    return hmac.new(secret_key() if key is None else key, _canonical(entry), hashlib.sha256).hexdigest()


def _warn_once(directory: Path, message: str) -> None:
    if str(directory) not in _warned:
        _warned.add(str(directory))
        warnings.warn(message, stacklevel=3)


def _usable_key(directory: Path) -> bytes | None:
    try:
        return secret_key()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        _warn_once(key_path(), f"cannot read or make the plan cache key {key_path()} ({reason}); compiling without "
                               f"the cache {directory}. Set LUMINAL_RECIPES_CACHE_KEY to a file of your own.")
        return None


def entry_limit(graph: Graph | None) -> int:
    """The largest entry file read for ``graph``: ``MAX_ENTRY_BYTES`` plus its array constants in base64."""
    data = 0 if graph is None else sum(n.data.nbytes for n in graph.nodes if n.data is not None)
    return MAX_ENTRY_BYTES + 2 * data


def read_signed(path: Path, info: os.stat_result, limit: int, secret: bytes, fmt: str, version: int,
                what: str) -> dict:
    """The JSON of the entry file ``path`` (``info``: its stat) once it proves to be ours: a regular file (checked
    again on the open file) of at most ``limit`` bytes, never read past it, of format ``fmt`` at ``version``, whose
    HMAC under ``secret`` matches. Raises ValueError saying why not, OSError when it cannot be read. Every signed
    cache (plans, the torch backend's translations) reads through here."""
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("it is not a regular file")
    if info.st_size > limit:
        raise ValueError(f"it is {info.st_size} bytes, more than the {limit} such an entry may be")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("it is not a regular file")
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"it is more than the {limit} bytes such an entry may be")
    data = json.loads(raw.decode("utf-8"))  # nesting past the recursion limit: RecursionError, untrusted
    if not isinstance(data, dict) or data.get("format") != fmt or data.get("version") != version:
        got = data.get("version") if isinstance(data, dict) else None
        raise ValueError(f"not a version {version} {what} (version {got!r})")
    if not isinstance(data.get("checksum"), str) or \
            not hmac.compare_digest(data["checksum"], _checksum(data, secret)):
        raise ValueError("its content does not match its checksum (edited, damaged, or written under another key)")
    return data


def signed(entry: dict, secret: bytes) -> str:
    """``entry`` as the JSON text of a signed cache file: its checksum covers exactly what a reader will see."""
    entry = json.loads(json.dumps(entry, default=str))
    entry["checksum"] = _checksum(entry, secret)
    return json.dumps(entry)


# ---- the store ---------------------------------------------------------------------------------------------
def load(key: str, graph: Graph | None = None, dims: dict | None = None,
         kernels=None) -> tuple[Program, dict] | None:
    """The cached program and search report for ``key``, or None (a miss, or an entry not to be trusted).

    The entry must carry this user's HMAC and, when ``graph`` is given, be a program of ``graph`` for the bucket
    ``dims`` using only ``kernels`` (``plan_check``); otherwise it is ignored with a warning, and the compile that
    follows replaces it."""
    directory = cache_dir()
    path = directory / f"{key}.json"
    limit = entry_limit(graph)
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # a miss (a file where the folder should be: store says so)
        return None
    except OSError as exc:
        _warn_once(directory, f"cannot read the plan cache entry {path} ({exc.strerror or exc}); compiling "
                              f"without the cache. Set LUMINAL_RECIPES_CACHE to a usable folder.")
        return None
    tempfiles.sweep_once(directory)
    secret = _usable_key(directory)
    if secret is None:
        return None
    try:
        try:
            data = read_signed(path, info, limit, secret, FORMAT, VERSION, "plan entry")
        except OSError as exc:  # e.g. a folder without read permission
            _warn_once(directory, f"cannot read the plan cache entry {path} ({exc.strerror or exc}); compiling "
                                  f"without the cache. Set LUMINAL_RECIPES_CACHE to a usable folder.")
            return None
        report = data.get("report", {})
        if not isinstance(report, dict):
            raise ValueError("its report is not a mapping")
        if graph is None:
            return program_from_json(data["program"]), report
        return check_program(data.get("program"), graph, dict(dims or {}), kernels), report
    except Exception as exc:  # any entry that cannot be trusted is rebuilt, never used
        reason = " ".join(str(exc).split())[:300]
        warnings.warn(f"plan cache entry {path} is unreadable or untrusted ({type(exc).__name__}: {reason}); "
                      f"ignoring it and compiling again (the new plan replaces it)", stacklevel=2)
        return None


def store(key: str, program: Program, report: dict) -> Path | None:
    """Write the entry for ``key``; None (with a warning, once per folder) when the cache is not writable."""
    directory = cache_dir()
    path = directory / f"{key}.json"
    secret = _usable_key(directory)
    if secret is None:
        return None
    text = signed({"format": FORMAT, "version": VERSION, "program": program_to_json(program), "report": report},
                  secret)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfiles.create_temp(path, 0o666)
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
    except BaseException:  # including KeyboardInterrupt (and SIGTERM, see cli): no half-written entry stays
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
