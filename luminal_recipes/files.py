"""Opening the files a user or a recipe names: regular files only, read whole only up to a size cap.

A FIFO (named pipe), a device or a socket passed where a file is expected would block the run forever or never
end (``/dev/zero``), and a folder is not a file either; each is refused with a message that says what it is.
The file is opened with ``O_NONBLOCK`` (so opening a FIFO returns at once) and checked with ``fstat`` on the
open descriptor, so nothing can swap the file between the check and the read. A symbolic link whose target does
not exist is refused too (only a name with nothing behind it is "absent": ``present``).

Fences: a checkpoint folder a recipe names (``weights:``, ``python://``, a hub snapshot) may hold no symbolic link
that leads out of the folders its author controls (``recipe.paths.checkpoint_roots``). ``fence(folder, roots)``,
called where such a checkpoint is resolved, walks the folder once and refuses any link leading out (before any
work), and records the fence: from then on every file under ``folder`` that ``open_regular`` (and so
``read_regular``, ``read_regular_text``) opens is checked, links resolved, before it is opened and again, on the
open descriptor, after. Every reader of checkpoint files (tokenizer files, chat templates, configs,
model_index.json, generation_config.json, scheduler configs, safetensors files and indexes) opens them here.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import stat
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CheckpointError, LuminalError

MAX_JSON_BYTES = 16 << 20  # configs are a few KB: a larger "config" is the wrong file

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO (named pipe)"); "a regular file" for files."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def not_regular(path: str | PathLike) -> str | None:
    """None when ``path`` is a regular file (symlinks followed) or does not exist; else what it is instead."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)


def present(path: str | PathLike) -> bool:
    """Whether anything is at ``path``: a file, a folder, a FIFO, a link (even one whose target is missing).
    Optional files are read when present, so that what is there but is not a file is refused, not skipped."""
    return os.path.lexists(path)


def open_regular(path: str | PathLike, what: str, error: type[LuminalError] = LuminalError) -> BinaryIO:
    """``path`` opened for binary reading; ``error`` naming ``what`` (e.g. "the recipe") if it is not a regular
    file or is a link to nothing; ``CheckpointError`` if it lies in a fenced checkpoint folder (``fence``) and
    leads out of it. OSErrors (missing file, no permission) propagate for the caller to phrase."""
    guard = fence_of(path)
    if guard is not None:  # before opening: a link out is refused, never opened (a FIFO or device neither)
        guard.check(path, os.path.realpath(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{path}: {what} is a symbolic link to {os.readlink(path)}, which does not exist; "
                        f"restore the file or the link.") from None
        raise
    try:
        if guard is not None:  # what was opened, in case a link was swapped in after the check above
            guard.check(path, _opened_path(fd, path))
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {what} must be a regular file, but this is {kind_of(mode)}.")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | PathLike, what: str, limit: int | None = None,
                 error: type[LuminalError] = LuminalError) -> bytes:
    """The bytes of the regular file ``path``; ``error`` if it is something else or larger than ``limit``."""
    with open_regular(path, what, error) as handle:
        size = os.fstat(handle.fileno()).st_size
        if limit is not None and size > limit:
            raise error(f"{path}: {what} is {_size(size)}, more than the {_size(limit)} this tool reads; "
                        f"is it the right file?")
        data = handle.read(limit + 1 if limit is not None else -1)
    if limit is not None and len(data) > limit:  # grew while being read
        raise error(f"{path}: {what} is more than the {_size(limit)} this tool reads; is it the right file?")
    return data


def read_regular_text(path: str | PathLike, what: str, limit: int | None = None,
                      error: type[LuminalError] = LuminalError) -> str:
    """``read_regular`` decoded as UTF-8; ``error`` naming the byte offset when it is not UTF-8 text."""
    data = read_regular(path, what, limit, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{Path(path)}:{line}: {what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                    f"{exc.start}); save it as UTF-8.") from None


def name_problem(path: str | PathLike) -> str | None:
    """Why ``path`` cannot name a file to be written (in words), or None: a part longer than the file system's
    NAME_MAX (255 bytes on Linux), a path the system refuses to look up (too long, a NUL byte, no permission on
    the way). Checked before any work, where pathlib's own checks would raise these as OSErrors after it."""
    existing = Path(os.path.abspath(path)).parent
    while not os.path.isdir(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
    if longest > limit:
        return f"a name in it is {longest} bytes long, more than the {limit} a file name may have here"
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None  # to be made: whether its folder can be written is the caller's check
    except (OSError, ValueError) as exc:  # ENAMETOOLONG for the whole path, EACCES on the way, a NUL byte
        return f"it cannot be used as a file name ({getattr(exc, 'strerror', None) or exc})"
    return None


# ---- fences around the checkpoint folders recipes name -------------------------------------------------------
MAX_AUDIT_ENTRIES = 200_000  # a checkpoint holds tens of files; past this many the walk stops (opens still checked)


@dataclass(frozen=True)
class Fence:
    """Where the files under a checkpoint folder may resolve to (``roots``, resolved), the recipe line that named
    the checkpoint (``where``) and those roots in words (``inside``), for messages."""

    folder: str
    roots: tuple[str, ...]
    where: str
    inside: str
    hint: str = ""  # how else to proceed, appended to the message

    def allows(self, real: str) -> bool:
        return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots)

    def check(self, path: str | PathLike, real: str) -> None:
        if not self.allows(real):
            raise CheckpointError(
                f"{self.where}: {path} resolves to {real} through a symbolic link, outside {self.inside} "
                f"({self.roots[0]}); files read from a folder a recipe names stay inside it. Copy the file there "
                f"instead of linking it{self.hint}.")


_FENCES: dict[str, Fence | None] = {}  # folder (absolute, as given and resolved) -> its fence (None: unfenced)
_LOCK = threading.Lock()


def fence(folder: str | PathLike, roots: Iterable[str | PathLike] | None, where: str = "", inside: str = "",
          hint: str = "") -> None:
    """Fence the checkpoint ``folder``: refuse now (naming ``where``, the recipe line that names it) any symbolic
    link under it that resolves outside ``roots``, and check every file opened under it from now on (see the
    module's docstring). ``roots`` None (a folder the user named) lifts a fence on that folder."""
    keys = {os.path.abspath(folder), os.path.realpath(folder)}
    with _LOCK:
        if roots is None:  # the user's own folder, even inside a fenced one
            for key in keys:
                _FENCES[key] = None
            return
        real_roots = tuple(os.path.realpath(root) for root in roots)
        outer = fence_of(folder)
        if outer is not None and outer.roots == real_roots:
            return  # already fenced and walked (the same folder, or one it lies in)
        guard = Fence(os.path.abspath(folder), real_roots, where, inside, hint)
        guard.check(folder, os.path.realpath(folder))
        _walk(folder, guard)
        for key in keys:
            _FENCES[key] = guard


def fence_of(path: str | PathLike) -> Fence | None:
    """The fence of the innermost fenced folder ``path`` lies in (as written, made absolute), or None."""
    if not _FENCES:
        return None
    absolute = os.path.abspath(path)
    found = None
    for key, guard in list(_FENCES.items()):
        if (absolute == key or absolute.startswith(key.rstrip(os.sep) + os.sep)) and \
                (found is None or len(key) > len(found[0])):
            found = key, guard
    return None if found is None else found[1]


def check_fence(path: str | PathLike) -> None:
    """``CheckpointError`` if ``path`` lies in a fenced checkpoint folder and resolves outside it: for a library
    that opens a path itself (``open_regular`` checks this on its own)."""
    guard = fence_of(path)
    if guard is not None:
        guard.check(path, os.path.realpath(path))


def _walk(folder: str | PathLike, guard: Fence) -> None:
    """Every symbolic link under ``folder`` (through links to folders that stay inside) resolves inside."""
    stack, seen, count = [os.fspath(folder)], set(), 0
    while stack:
        current = stack.pop()
        real = os.path.realpath(current)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue  # unreadable: a file opened from it is checked then
        for entry in entries:
            count += 1
            if count > MAX_AUDIT_ENTRIES:
                return
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                guard.check(entry.path, target)
                if os.path.isdir(target):
                    stack.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)


def _opened_path(fd: int, path: str | PathLike) -> str:
    """The path of the file open on ``fd`` (Linux: /proc/self/fd), else ``path`` resolved."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened.startswith("/") and not opened.endswith(" (deleted)"):
            return opened
    except OSError:
        pass
    return os.path.realpath(path)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---- JSON ---------------------------------------------------------------------------------------------------------
MAX_JSON_DEPTH = 128  # configs nest a few levels; Python's parser would recurse (and fail) near 1,000
# A string, or an unterminated one up to the end of the text: a match never fails once it starts at a quote, so
# a scan is linear even for text full of quotes and escapes ('"' + '\\"' * n had every quote start a failing scan
# to the end: quadratic). The parser then reports the unterminated string.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_JSON_FIX = "fix the file, or download or write it again"


def parse_json(text: str, where: str, error: type[LuminalError] = LuminalError, *, fix: str = _JSON_FIX,
               max_depth: int = MAX_JSON_DEPTH, nonfinite: bool = False, kind: str = "JSON") -> Any:
    """``text`` parsed as JSON, with the bounds untrusted files need, checked before or while parsing: nesting at
    most ``max_depth`` arrays/objects deep (checked by one linear scan before the parser, which recurses), no key
    twice in one object, and unless ``nonfinite``: no NaN/Infinity constants and no number beyond a double's range
    (``1e400``). Anything else (a syntax error, an integer of more than 4,300 digits) is ``error`` too, naming
    ``where`` (the file, with line and column where known) and ``fix`` (a syntax error: "not valid ``kind``")."""
    too_deep = _depth_beyond(text, max_depth)
    if too_deep is not None:
        raise error(f"{where}:{too_deep}: the JSON nests arrays/objects more than {max_depth} deep, which no "
                    f"configuration needs (this tool reads at most {max_depth}); {fix}.")

    def constant(name: str) -> float:
        raise error(f"{where}{_locate(text, name)}: {_keyed(text, name)}{name} is not a number JSON allows, nor a "
                    f"value this tool accepts; {fix}.")

    def number(literal: str) -> float:
        value = float(literal)
        if not nonfinite and not math.isfinite(value):
            raise error(f"{where}{_locate(text, literal)}: {_keyed(text, literal)}{_clip(literal)} is beyond a "
                        f"double's range; {fix}.")
        return value

    def pairs(items: list[tuple[str, Any]]) -> dict:
        out = dict(items)
        if len(out) != len(items):
            seen: set[str] = set()
            twice = next(key for key, _ in items if key in seen or seen.add(key))
            key = json.dumps(twice)
            raise error(f"{where}{_locate(text, key, second=True)}: key {_clip(key)} appears twice "
                        f"in one object, so which value counts is ambiguous; {fix}.")
        return out

    try:
        value = json.loads(text, parse_float=number, object_pairs_hook=pairs,
                           **({} if nonfinite else {"parse_constant": constant}))
        lone = _lone_surrogate(text, value) if _SURROGATE_ESCAPE.search(text) else None
        if lone is not None:  # "\ud800" parses, but is no character: tokenizers and printing fail on it later
            raise error(f"{where}{_locate(text, lone)}: {_keyed(text, lone)}the escape {lone} is half of a UTF-16 "
                        f"surrogate pair, not a character (the text is not valid Unicode); {fix}.")
        return value
    except json.JSONDecodeError as exc:
        raise error(f"{where}:{exc.lineno}:{exc.colno}: not valid {kind} ({exc.msg}); {fix}.") from None
    except RecursionError:  # not reached after the depth scan; kept so no parser recursion escapes as a traceback
        raise error(f"{where}: the JSON nests too deep to read; {fix}.") from None
    except ValueError:  # the one ValueError left: an integer of more digits than Python converts
        raise error(f"{where}: the JSON holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                    f"which no configuration needs; {fix}.") from None


def read_json(path: str | PathLike, what: str, limit: int | None = MAX_JSON_BYTES,
              error: type[LuminalError] = LuminalError, *, where: str | None = None, fix: str = _JSON_FIX,
              max_depth: int = MAX_JSON_DEPTH, nonfinite: bool = False) -> Any:
    """The JSON file ``path`` (``what``, e.g. "the tokenizer config") parsed by ``parse_json``: a regular file of
    at most ``limit`` bytes, UTF-8, bounded in depth; ``error`` naming ``where`` (default: the path) otherwise.
    OSErrors (a missing file) propagate for the caller to phrase, as ``read_regular`` does."""
    text = read_regular_text(path, what, limit, error)
    return parse_json(text, str(path) if where is None else where, error, fix=fix, max_depth=max_depth,
                      nonfinite=nonfinite)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(text: str, value: Any) -> str | None:
    """The first ``\\uD8xx``-``\\uDFxx`` escape of ``text`` that stands alone (not one half of a pair), when a
    string of ``value`` (its keys included) holds a lone surrogate; else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                break
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    else:
        return None
    for match in _SURROGATE_ESCAPE.finditer(text):
        code = int(match.group()[2:], 16)
        after = text[match.end():match.end() + 6]
        paired = code < 0xDC00 and re.fullmatch(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}", after)
        before = text[max(0, match.start() - 6):match.start()]
        if paired or (code >= 0xDC00 and re.fullmatch(r"\\u[dD][89abAB][0-9a-fA-F]{2}", before)):
            continue
        return match.group()
    return "\\uD800"


def _depth_beyond(text: str, limit: int) -> int | None:
    """The line of ``text`` where brackets first nest deeper than ``limit`` (brackets in strings not counted), or
    None: strings dropped by a linear regex, then a running sum of the brackets, in chunks (numpy)."""
    bare = _JSON_STRING.sub('""', text) if '"' in text else text  # strings hold no raw newline: lines are kept
    if bare.count("[") + bare.count("{") <= limit:
        return None
    import numpy as np

    step = np.zeros(256, np.int8)
    step[[ord("["), ord("{")]] = 1
    step[[ord("]"), ord("}")]] = -1
    data = np.frombuffer(bare.encode("ascii", "replace"), np.uint8)  # one byte per character
    carry, chunk = 0, 1 << 22
    for start in range(0, data.size, chunk):
        depth = np.cumsum(step[data[start:start + chunk]], dtype=np.int32) + carry
        over = np.flatnonzero(depth > limit)
        if over.size:
            return bare.count("\n", 0, start + int(over[0])) + 1
        carry = int(depth[-1])
    return None


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _locate(text: str, token: str, second: bool = False) -> str:
    """":line:col" of the first (or second) occurrence of ``token`` in ``text`` (where a parser hook cannot
    tell), or ""."""
    at = text.find(token)
    if second and at >= 0:
        at = text.find(token, at + 1)
    return "" if at < 0 else ":{}:{}".format(*_line_col(text, at))


_KEY_BEFORE = re.compile(r'"([^"\\]{1,80})"\s*:\s*-?$')


def _keyed(text: str, token: str) -> str:
    """'"key": ' when the first ``token`` in ``text`` is an object's value (to name it in a message), else ""."""
    at = text.find(token)
    found = _KEY_BEFORE.search(text, max(0, at - 100), at) if at >= 0 else None
    return f'"{found[1]}": ' if found else ""


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
