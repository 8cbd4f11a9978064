"""The one check every text a user gives (a prompt, ``--system``, ``--stop``, a ``--chat-var`` string) passes
before it reaches a chat template or a tokenizer: it is text UTF-8 can encode.

Python hands a command-line argument (or a file read with ``errors="surrogateescape"``) that is not UTF-8 over as a
string holding lone surrogates, U+DC80..U+DCFF for the bytes 0x80..0xFF; the ``tokenizers`` package refuses such a
string with ``TypeError: TextInputSequence must be str``. This names the text and the byte instead.
"""

from __future__ import annotations

from typing import Any

from ..errors import LuminalError

ECHO_CHARS = 60  # the most of a text an error message quotes


def quote(text: str, limit: int = ECHO_CHARS) -> str:
    """``repr(text)`` (undecodable bytes shown as ``\\udcXX``), cut to about ``limit`` characters."""
    shown = repr(text[: limit + 1])
    return shown if len(text) <= limit else f"{repr(text[:limit])[:-1]}...' ({len(text)} characters)"


def check_text(value: Any, what: str, error: type[LuminalError]) -> Any:
    """``value`` (a string, or a list/dict holding strings) if all its text encodes as UTF-8; else ``error``
    naming ``what`` (the flag or prompt), the byte that is not UTF-8 and where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            bad = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                   else f"U+{code:04X}, a lone surrogate")
            raise error(f"{what} {quote(value)} is not valid UTF-8 text ({bad} at character {exc.start}); pass it "
                        f"as UTF-8 (convert it with e.g. `iconv -t UTF-8`).") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_text(item, what, error)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, what, error)
            check_text(item, what, error)
    return value
