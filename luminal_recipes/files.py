"""Opening the files a user or a recipe names: regular files only, read whole only up to a size cap.

A FIFO (named pipe), a device or a socket passed where a file is expected would block the run forever or never
end (``/dev/zero``), and a folder is not a file either; each is refused with a message that says what it is.
The file is opened with ``O_NONBLOCK`` (so opening a FIFO returns at once) and checked with ``fstat`` on the
open descriptor, so nothing can swap the file between the check and the read.
"""

from __future__ import annotations

import fcntl
import os
import stat
from os import PathLike
from pathlib import Path
from typing import BinaryIO

from .errors import LuminalError

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


def open_regular(path: str | PathLike, what: str, error: type[LuminalError] = LuminalError) -> BinaryIO:
    """``path`` opened for binary reading; ``error`` naming ``what`` (e.g. "the recipe") if it is not a regular
    file. OSErrors (missing file, no permission) propagate for the caller to phrase."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
