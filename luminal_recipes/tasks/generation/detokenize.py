"""Token ids -> text, one token at a time, never printing half a character or part of a stop string.

``IncrementalDetokenizer`` decodes a window of the reply's ids (from a prefix offset, so a tokenizer that strips or
merges across token boundaries sees context) and releases the new text only when it does not end in an incomplete
UTF-8 sequence (a byte-fallback token of a multi-byte character decodes to U+FFFD until its last byte arrives).
The pieces it releases add up to ``tokenizer.decode(reply)``. ``StopStrings`` holds back text that could be the
start of a stop string and ends the reply at the first one, which is not part of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...errors import InputError

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(id)`` -> the text that token completes (often "", sometimes several characters)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to the text already released at their end
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # nothing complete yet (a partial character, or a token that prints nothing by itself)
        if not after.startswith(before):  # the tokenizer rewrote earlier text given more context: release the rest
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            new = after[common:]
        else:
            new = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def flush(self) -> str:
        """What is left at the end of the reply (an incomplete character is printed as U+FFFD, as decode does)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):] if after.startswith(before) else after


class StopStrings:
    """``feed(text)`` -> (text safe to print, whether a stop string was reached); ``flush()`` releases what was held
    back at the end of a reply that did not stop on a string."""

    def __init__(self, stops: Sequence[str] | str | None):
        if stops is None:
            stops = ()
        elif isinstance(stops, str):  # one stop string, not one per character
            stops = (stops,)
        elif not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            shown = repr(stops) if len(repr(stops)) <= 60 else repr(stops)[:57] + "..."
            raise InputError(f"--stop {shown}: expected a string or a list of strings")
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[: min(hits)], True
        keep = 0  # the longest tail of buf that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
