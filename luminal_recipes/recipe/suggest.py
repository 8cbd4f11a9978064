"""'Did you mean' hints for misspelt keys and names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or the empty string."""
    candidates = sorted({str(k) for k in known})
    close = difflib.get_close_matches(str(name), candidates, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        if str(name).lower() in lowered:
            close = [lowered[str(name).lower()]]
    return f" (did you mean '{close[0]}'?)" if close else ""


def one_of(known: Iterable[str], limit: int = 12) -> str:
    """A short readable list of allowed names."""
    names = sorted({str(k) for k in known})
    if len(names) > limit:
        return ", ".join(names[:limit]) + f", ... ({len(names)} in all)"
    return ", ".join(names) if names else "(none)"
