"""The temporary files this tool writes before renaming them into place, and the sweep of stale ones.

Every file written atomically (a PNG or another output, a golden record, a plan-cache entry, a compiled CUDA
module, the plan cache's key) is first written to a temporary file beside it, named by ``temp_path``:
``.<name>.<pid>.<12 hex>.tmp`` (the target's name, at most 100 characters of it; the writer's process id; a
random part). A write that fails or is interrupted (Ctrl-C, or SIGTERM or SIGHUP: the command line turns them
into the same exception) removes its temporary file; only a process killed outright (SIGKILL, a power cut) can
leave one. Such leftovers are removed by ``sweep`` the next time this tool writes into the same folder, and by
``luminal-recipe cache clear``: a file is removed only when its name has exactly this pattern, it is a regular
file (never a link or a folder), it was last modified more than ``STALE_AFTER_S`` ago, and the process named in it
is not running on this machine. A temporary file that another process is still writing is therefore never
removed (a live writer, or a recent one, keeps it).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from pathlib import Path

STALE_AFTER_S = 3600  # younger temporary files may belong to a write in progress (on this or another machine)
_NAME_CHARS = 100  # of the target's name kept in the temporary's: the whole name stays within NAME_MAX
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)\.(?P<rand>[0-9a-f]{12})\.tmp$")
_swept: set[str] = set()  # folders swept in this process


def temp_path(target: str | os.PathLike) -> Path:
    """The temporary file to write ``target`` through (in the same folder, so a rename moves it into place)."""
    target = Path(target)
    return target.parent / f".{target.name[:_NAME_CHARS]}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def create_temp(target: str | os.PathLike, mode: int = 0o666) -> tuple[int, Path]:
    """A new temporary file for ``target``, opened exclusively for writing: ``(fd, path)``. Creating it first
    sweeps the folder's stale temporaries (once per process and folder)."""
    target = Path(target)
    sweep_once(target.parent)
    while True:
        path = temp_path(target)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        except FileExistsError:  # 48 random bits met another file of the same name: draw again
            continue
        return fd, path


def write_atomic(target: str | os.PathLike, data: bytes, mode: int = 0o666, fsync: bool = True) -> Path:
    """Write ``data`` to ``target`` through a temporary file and a rename (replacing ``target``); on any failure
    or interruption the temporary file is removed and the exception propagates."""
    target = Path(target)
    fd, temp = create_temp(target, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return target


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # another user's process (or a pid we cannot ask about)
        return True
    return True


def is_stale(path: Path, now: float | None = None) -> bool:
    """Whether ``path`` is a temporary file of this tool that nobody is writing any more (see the module doc)."""
    match = TEMP_NAME.match(path.name)
    if match is None:
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    now = time.time() if now is None else now
    if now - info.st_mtime <= STALE_AFTER_S:
        return False
    return not _running(int(match["pid"]))


def stale(folder: str | os.PathLike) -> list[Path]:
    """The stale temporary files directly in ``folder`` (none if it cannot be listed)."""
    folder = Path(folder)
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(folder / n for n in names if TEMP_NAME.match(n) and is_stale(folder / n, now))


def sweep(folder: str | os.PathLike) -> tuple[int, int]:
    """Remove the stale temporary files directly in ``folder``; returns (files removed, bytes freed). Never
    raises: a file that vanished or cannot be removed is skipped."""
    removed = freed = 0
    for path in stale(folder):
        try:
            size = path.lstat().st_size
            path.unlink()
        except OSError:
            continue
        removed += 1
        freed += size
    return removed, freed


def sweep_once(folder: str | os.PathLike) -> None:
    """``sweep(folder)`` the first time this process writes there."""
    key = os.path.abspath(folder)
    if key not in _swept:
        _swept.add(key)
        sweep(folder)
