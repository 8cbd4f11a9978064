"""Write a file atomically: to a temporary name beside it, then into place, so a reader never sees a partial
file and a failed write leaves nothing behind (the temporary file's name and the sweep of ones a killed process
left: ``luminal_recipes.tempfiles``). Without ``overwrite`` the file is only ever created, never
replaced, even when another process creates the same name meanwhile (``os.link`` fails on an existing name)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import PipelineError
from ..tempfiles import create_temp


class OutputExistsError(PipelineError):
    """The target exists and overwriting was not asked for."""


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, overwrite: bool, what: str = "output") -> Path:
    """Create ``path`` with what ``write(handle)`` writes; replace an existing file only when ``overwrite``.

    Raises ``OutputExistsError`` if ``path`` exists and ``overwrite`` is false, ``PipelineError`` naming the path
    on any other failure; neither leaves a temporary or partial file behind."""
    path = Path(path)
    if path.is_dir():
        raise PipelineError(f"--output {path}: is a folder; give a file name.")
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never reuse someone else's file; mode 0o666 lets the umask decide, as for any new file.
        fd, temp = create_temp(path, 0o666)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(temp, path)
        elif not _create(temp, path):
            raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise PipelineError(
            f"--output {path}: cannot write the {what} ({reason}); choose a writable location with --output."
        ) from None
    finally:  # also on KeyboardInterrupt (Ctrl-C, and SIGTERM through the command line's handler)
        if temp is not None and temp.exists():
            temp.unlink()
    return path


def _create(temp: Path, path: Path) -> bool:
    """Move ``temp`` to ``path`` only if ``path`` does not exist; False if it does."""
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    # a file system without hard links: claim the name exclusively, then move the complete file over it
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    os.replace(temp, path)
    return True
